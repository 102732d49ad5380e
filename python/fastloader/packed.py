"""Packed arrays: dataset metadata that no worker copies, under any start method.

A Python list of 2M file names is 2M objects. A forked worker that reads them
writes their reference counts, so the kernel copies every page it reads
("copy-on-read": about +200 MiB per worker over an epoch); under spawn and
forkserver the list is pickled into every worker instead. A packed array keeps
the items in one shared segment (UTF-8 bytes or pickles back to back, plus int64
offsets) and creates a Python object only for the item you ask for:

    names = PackedStringArray(all_names)           # or .from_file / .from_directory / .load
    names[i]                                       # -> str, ~0.1 us, in C
    records = PackedArray(coco["annotations"])     # any picklable records
    records[i]                                     # -> a fresh dict each time

Sharing:

* fork: workers inherit the mapping; reading an item touches no Python object of
  the array, so no page is copied.
* spawn / forkserver: pickling an array while a process starts sends a handle,
  not the data; the worker maps the same pages. Outside a process start (plain
  ``pickle.dumps``, a ``multiprocessing.Queue``) the items themselves are pickled,
  so a pickle stays self-contained.
* ``sharing_strategy="file_descriptor"`` (default): an anonymous, sealed memfd,
  passed to workers by fd; freed by the kernel with the last process that has it.
  ``"file_system"``: a named segment ``/dev/shm/fastloader-pack-*`` (mode 0600)
  that workers open by name; the creating process unlinks it when the array is
  freed or at exit, and multiprocessing's resource tracker unlinks it if that
  process dies first (even by SIGKILL). An array's strategy is chosen when it is
  built (``share()`` converts); it need not match the loader's ``sharing_strategy``.
* ``save(path)`` writes one file atomically (a temporary file, fsync, rename);
  ``PackedStringArray.load(path)`` memory-maps it, in O(1). Every offset is read
  once and bounds-checked before use, so a corrupt, hostile or concurrently
  changing file gives an exception (or stale items), never a read or write out of
  bounds. The one thing a reader cannot survive is a file cut short under its
  mapping (SIGBUS). So a file another user could cut short (theirs, root's aside,
  or writable by others or by a group other than our user private group) is
  copied into a sealed segment at load (a read of the whole file) instead of
  mapped; and for your own files: do not truncate or rewrite a loaded file in
  place; replace it by renaming a new file over it, as save() does.
* Nothing from a file is unpickled unless you ask for pickled records by name:
  ``PackedArray.load(path)`` (trusted files only: reading a record unpickles it,
  which can run any code). ``PackedStringArray.load`` and ``fastloader.packed.load``
  refuse such files.
"""
from __future__ import annotations

import contextlib
import errno
import io
import os
import stat
import threading
import uuid
import weakref
from typing import Any, Iterable, Optional, Union

from . import _core
from ._core import FastLoaderError
from .seals import seal_immutable
from .sharing import DEFAULT_STRATEGY, STRATEGIES, packed_segment_name  # noqa: F401
from .sharing import check_strategy as _check_strategy

__all__ = ["PackedStringArray", "PackedArray", "PackedFormatError", "load",
           "attach_node_handle"]

_DEFAULT_STRATEGY = DEFAULT_STRATEGY
_SHM_DIR = "/dev/shm"
_NDARRAY_CHUNK = 1 << 16     # items converted to Python objects at a time
_READ_CHUNK = 4 << 20         # bytes of a text file read at a time


class PackedFormatError(FastLoaderError, ValueError):
    """A file or pickle is not a valid packed array (foreign, truncated, corrupt)."""


# ---- segments --------------------------------------------------------------------------

def _tracker(action: str, name: str) -> None:
    # multiprocessing's resource tracker unlinks a registered segment once every
    # process that could unregister it is gone: the crash-safety net for named segments.
    from multiprocessing import resource_tracker

    getattr(resource_tracker, action)("/" + name, "shared_memory")


def _release(fd: int, name: Optional[str], owner_pid: int) -> None:
    """Finalizer of a segment: close our fd; the creating process also unlinks the name
    (a forked child inherits this finalizer and must leave the name alone)."""
    if fd >= 0:
        try:
            os.close(fd)
        except OSError:
            pass
    if name is not None and os.getpid() == owner_pid:
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:
            pass
        try:
            _tracker("unregister", name)
        except Exception:   # interpreter shutdown: the tracker cleans up after us anyway
            pass


class _Segment:
    """The memory under a packed array and how another process attaches to it.

    kind: "memfd" (file_descriptor strategy), "shm" (file_system strategy, named),
    or "file" (load()). ``fd`` is kept only where a child needs it: a memfd, or a
    loaded file shared by fd; a named segment or file is reopened by its name."""

    __slots__ = ("kind", "strategy", "fd", "size", "mapping", "name", "path", "ident",
                 "_finalizer", "__weakref__")

    def __init__(self, kind, strategy, fd, size, *, name=None, path=None, ident=None,
                 populate=False, keep_fd=True, owner=False):
        self.kind = kind
        self.strategy = strategy
        self.size = size
        self.name = name
        self.path = path
        self.ident = ident
        self.fd = -1
        self._finalizer = None
        # on failure the caller still owns fd (and the name)
        self.mapping = _core.PackedMapping(fd, size, populate)
        if not keep_fd:
            os.close(fd)
            fd = -1
        self.fd = fd
        self._finalizer = weakref.finalize(self, _release, fd, name if owner else None,
                                           os.getpid())

    def handle(self):
        """What a starting child process needs to map this segment (called while
        multiprocessing pickles the child's arguments)."""
        if self.kind == "shm":
            return ("shm", self.name, self.size, self.ident)
        if self.kind == "file" and self.strategy == "file_system":
            return ("path", self.path, self.size, self.ident)
        from multiprocessing import reduction

        return ("fd", reduction.DupFd(self.fd), self.size, self.kind)


def _new_segment(strategy: str):
    """An empty segment to write into: (kind, fd, name)."""
    if strategy == "file_descriptor":
        fd = os.memfd_create("fastloader-pack", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        return "memfd", fd, None
    name = packed_segment_name()
    fd = os.open(os.path.join(_SHM_DIR, name),
                 os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        os.fchmod(fd, 0o600)   # whatever the umask did
        _tracker("register", name)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(_SHM_DIR, name))
        raise
    return "shm", fd, name


def _discard(fd: int, name: Optional[str]) -> None:
    os.close(fd)
    if name is not None:
        try:
            os.unlink(os.path.join(_SHM_DIR, name))
        except FileNotFoundError:
            pass
        _tracker("unregister", name)


def _finish_segment(kind, fd, name, size, strategy) -> _Segment:
    if kind == "memfd":
        # Immutable from now on, for us and for every worker the fd is passed to.
        seal_immutable(fd)
        # populate: the pages are then mapped here, so a worker's reads count as
        # shared memory, not as its private memory (USS), and never fault twice.
        return _Segment(kind, strategy, fd, size, populate=True)
    st = os.fstat(fd)
    return _Segment(kind, strategy, fd, size, name=name, ident=(st.st_dev, st.st_ino),
                    populate=True, keep_fd=False, owner=True)


def _build(cls, fill, strategy: str):
    """A new array of type `cls` whose items `fill(writer)` appends. On any error the
    segment is discarded: nothing half-built survives."""
    _check_strategy(strategy)
    kind, fd, name = _new_segment(strategy)
    try:
        writer = _core.PackedWriter(fd, cls._KIND)
        fill(writer)
        size = writer.finish()
        del writer
        seg = _finish_segment(kind, fd, name, size, strategy)
    except BaseException:
        _discard(fd, name)
        raise
    return _core.PackedView.__new__(cls, seg, seg.mapping)


def _from_bytes(cls, data, strategy: str):
    """Unpickle a self-contained array (see _PackedBase.__reduce__)."""
    _check_strategy(strategy)
    view = memoryview(data)
    if len(view) < _core.PACKED_HEADER_SIZE:
        raise PackedFormatError(f"fastloader: packed array: truncated: {len(view)} bytes, "
                                f"shorter than the {_core.PACKED_HEADER_SIZE}-byte header")
    kind, fd, name = _new_segment(strategy)
    try:
        _reserve(fd, len(view))
        written = 0
        while written < len(view):
            written += os.write(fd, view[written:written + (1 << 30)])
        seg = _finish_segment(kind, fd, name, len(view), strategy)
    except BaseException:
        _discard(fd, name)
        raise
    try:
        return _core.PackedView.__new__(cls, seg, seg.mapping)
    except ValueError as exc:
        raise PackedFormatError(str(exc)) from None


def _reserve(fd: int, size: int) -> None:
    """Reserve a new segment's pages: a full /dev/shm (or memfd limit) is then a
    MemoryError naming the size, as for every other shared segment."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise
        raise MemoryError(f"fastloader: creating a {size}-byte packed array segment: "
                          f"{exc.strerror} (shared memory is exhausted)") from None


def _open_regular(path, flags):
    """(fd, stat) of `path` opened for reading, or None if it is not a regular file.
    O_NONBLOCK: opening a FIFO put in its place (by whoever can write where it
    lies) would block until someone opened its other end, before any check could
    refuse it; for a regular file the flag changes nothing, and it is cleared."""
    fd = os.open(path, flags | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def _attach(cls, handle, start, step, length):
    """Unpickle in a child process: map the parent's segment."""
    how = handle[0]
    if how == "fd":
        _, dup, size, kind = handle
        fd = dup.detach() if hasattr(dup, "detach") else dup
        try:
            seg = _Segment("memfd" if kind == "memfd" else "file", "file_descriptor", fd, size)
        except BaseException:
            os.close(fd)
            raise
    else:
        _, where, size, ident = handle
        if how == "shm":
            path = os.path.join(_SHM_DIR, where)
            flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW
        else:
            path, flags = where, os.O_RDONLY | os.O_CLOEXEC
        opened = _open_regular(path, flags)
        if opened is None:
            raise FastLoaderError(f"fastloader: packed array {path!r} is no longer the "
                                  "file the parent process mapped (not a regular file)")
        fd, st = opened
        try:
            now = (st.st_dev, st.st_ino) if how == "shm" else \
                (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
            if now != ident or st.st_size != size:
                raise FastLoaderError(f"fastloader: packed array {path!r} is no longer the "
                                      "file the parent process mapped (replaced or changed)")
        except BaseException:
            os.close(fd)
            raise
        kind = "shm" if how == "shm" else "file"
        try:
            seg = _Segment(kind, "file_system", fd, size, name=where if how == "shm" else None,
                           path=None if how == "shm" else where, ident=ident, keep_fd=False)
        except BaseException:
            os.close(fd)
            raise
    return _core.PackedView.__new__(cls, seg, seg.mapping, start, step, length)


def attach_node_handle(handle):
    """The packed array described by ``node_handle()`` in another process."""
    cls_name, how, start, step, length = handle
    cls = {c.__name__: c for c in _CLASSES.values()}.get(cls_name)
    if cls is None:
        raise ValueError(f"fastloader: not a packed-array handle: {handle!r}")
    if how[0] != "procfd":
        return _attach(cls, how, start, step, length)
    _, pid, fd_number, size, ident = how
    path = f"/proc/{pid}/fd/{fd_number}"
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise FastLoaderError(f"fastloader: cannot attach to the packed array of process "
                              f"{pid} ({exc}); is it still running, as this user?") from exc
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) != ident or st.st_size != size:
            raise FastLoaderError(f"fastloader: {path} is no longer the packed array that "
                                  f"process {pid} shared")
        seg = _Segment("memfd", "file_descriptor", fd, size)
    except BaseException:
        os.close(fd)
        raise
    return _core.PackedView.__new__(cls, seg, seg.mapping, start, step, length)


def _spawning() -> bool:
    from multiprocessing import context

    return context.get_spawning_popen() is not None


# The sharing strategy of the loader whose workers are being started (set by
# fastloader.pool around Process.start()): a packed array then travels the way
# the loader shares everything else, whatever strategy it was built with.
_STARTING = threading.local()
# array storage -> its twin under the other strategy, made once and reused
_TWINS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_TWINS_LOCK = threading.Lock()


@contextlib.contextmanager
def loader_strategy(strategy: str):
    previous = getattr(_STARTING, "strategy", None)
    _STARTING.strategy = strategy
    try:
        yield
    finally:
        _STARTING.strategy = previous


def starting_strategy():
    """The strategy of the loader whose workers this thread is starting, or None."""
    return getattr(_STARTING, "strategy", None)


def _for_loader(array):
    wanted = starting_strategy()
    if wanted is None or wanted == array.sharing_strategy:
        return array
    key = (wanted, array._start, array._step, len(array))
    with _TWINS_LOCK:   # workers start from several threads at once
        twins = _TWINS.setdefault(array._storage, {})
        if key not in twins:
            twins[key] = array.share(wanted)   # a copy, once per array and strategy
        return twins[key]


# ---- the array types -----------------------------------------------------------------------

def _pandas_items_differ(items) -> bool:
    """Whether a pandas column's own items differ from its to_numpy()'s: datetimes
    and timedeltas (Timestamps), and the nullable extension dtypes (pd.NA)."""
    if not type(items).__module__.startswith("pandas"):
        return False
    dtype = getattr(items, "dtype", None)   # (a DataFrame has none: to_numpy refuses it)
    if dtype is None:
        return False
    kind = getattr(dtype, "kind", "O")
    if type(dtype).__module__.startswith("numpy"):
        return kind in "mM"
    return kind in "mMbiufc"   # Int64, Float64, boolean, datetime with a time zone


class _PackedBase(_core.PackedView):
    """Shared behaviour of PackedStringArray and PackedArray."""

    __slots__ = ()
    _KIND = 0
    _ITEM = "item"

    # -- construction helpers --
    @classmethod
    def _fill_from(cls, items):
        if isinstance(items, (str, bytes, bytearray)):
            raise TypeError(f"{cls.__name__}() needs an iterable of items, not a single "
                            f"{type(items).__name__}")
        try:
            import numpy as np
        except ImportError:   # pragma: no cover - numpy is a dependency
            np = None
        if np is not None and not isinstance(items, np.ndarray) and \
                callable(getattr(items, "to_numpy", None)):
            # a pandas Series / Index (or pyarrow array): as its NumPy array, at C
            # speed, unless that would change the records: a pandas column of
            # datetimes or of a nullable dtype gives its own items (Timestamps,
            # pd.NA), as list(series) does, where to_numpy() makes ints or NaN
            if cls._KIND == _core.PACKED_STR or not _pandas_items_differ(items):
                items = items.to_numpy()
            else:
                return lambda w: w.extend(items)
        if np is not None and isinstance(items, np.ndarray):
            return cls._fill_from_ndarray(items)
        return lambda w: w.extend(items)

    @classmethod
    def _fill_from_ndarray(cls, arr):
        if arr.ndim != 1:
            raise ValueError(f"{cls.__name__}() needs a 1-d array, not {arr.ndim}-d")
        if cls._KIND == _core.PACKED_STR and arr.dtype.kind not in "UOT":
            raise TypeError(f"PackedStringArray() needs str items; a NumPy array of dtype "
                            f"{arr.dtype} has none (for bytes: arr.astype(str))")

        # tolist() gives numbers as Python's, the same values; datetimes and
        # timedeltas it turns into ints (of ns) or dates, and structured records
        # into tuples without their field names: those stay NumPy's scalars, as
        # list(arr) gives them
        as_python = arr.dtype.kind not in "mMV"

        def fill(w):
            # in chunks: a 10M-item array never becomes a 10M-item list
            for k in range(0, len(arr), _NDARRAY_CHUNK):
                chunk = arr[k:k + _NDARRAY_CHUNK]
                w.extend(chunk.tolist() if as_python else list(chunk))
        return fill

    def __new__(cls, items: Iterable = (), *, sharing_strategy: str = _DEFAULT_STRATEGY):
        if cls._KIND == 0:
            raise TypeError("use PackedStringArray or PackedArray")
        return _build(cls, cls._fill_from(items), sharing_strategy)

    @classmethod
    def load(cls, path, *, sharing_strategy: str = _DEFAULT_STRATEGY, populate: bool = False):
        """Memory-map a file of strings written by save(). O(1) (where it is
        mapped, not copied): the header is checked now, every item when it is read. A file of pickled records is
        refused (only PackedArray.load reads those).

        Do not truncate or rewrite a loaded file of yours in place (a
        process reading it would die of SIGBUS); replace it by renaming a
        new file over it, as save() does. A file another user could change
        is copied at load instead (see the module's docstring).

        populate=True maps every page now: slower to load, but workers then count
        the pages as shared rather than as their private memory."""
        return _load(cls, path, sharing_strategy, populate)

    # -- sharing --
    @property
    def sharing_strategy(self) -> str:
        """How workers attach: "file_descriptor" (fd passing) or "file_system" (by name)."""
        return self._storage.strategy

    def share(self, sharing_strategy: str) -> "_PackedBase":
        """This array under another sharing strategy (a copy, unless it has it already)."""
        _check_strategy(sharing_strategy)
        if sharing_strategy == self.sharing_strategy:
            return self
        return _from_bytes(type(self), self._serialize(), sharing_strategy)

    def node_handle(self):
        """A small picklable handle with which any process of this user on this
        machine (another rank, not only a child) attaches to the same pages through
        ``attach_node_handle(handle)``, while this process keeps the array alive.
        (fastloader.distributed.share_on_node exchanges it between local ranks.)"""
        seg = self._storage
        if seg.kind == "shm":
            how = ("shm", seg.name, seg.size, seg.ident)
        elif seg.kind == "file" and seg.path is not None:
            how = ("path", seg.path, seg.size, seg.ident)
        else:   # a memfd: reachable through /proc/<pid>/fd/<n> of a process that holds it
            st = os.fstat(seg.fd)
            how = ("procfd", os.getpid(), seg.fd, seg.size, (st.st_dev, st.st_ino))
        return (type(self).__name__, how, self._start, self._step, len(self))

    def __reduce__(self):
        if _spawning():
            shared = _for_loader(self)
            return _attach, (type(self), shared._storage.handle(), shared._start,
                             shared._step, len(shared))
        return _from_bytes, (type(self), self._serialize(), self.sharing_strategy)

    def __copy__(self):
        return self   # immutable

    def __deepcopy__(self, memo):
        return self

    # -- files --
    def save(self, path) -> None:
        """Write this array (a view: just its items) to one file, atomically: a
        temporary file in the same directory, flushed to disk (fsync), then renamed
        over `path`. A file already at `path` is replaced, never rewritten, so a
        process that has it loaded keeps reading the old items."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{uuid.uuid4().hex[:8]}.tmp")
        data = memoryview(self._mapping) if self._whole else memoryview(self._serialize())
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666)
            try:
                written = 0
                while written < len(data):
                    written += os.write(fd, data[written:written + (1 << 30)])
                os.fsync(fd)   # the data on disk before the name points at it
            finally:
                os.close(fd)
            os.replace(tmp, path)
            _fsync_directory(directory)   # and the rename too
        except BaseException as exc:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            if isinstance(exc, OSError) and exc.filename in (tmp, path):
                # the caller asked to write `path`: name it, not our temporary file
                exc.filename, exc.filename2 = path, None
            raise
        finally:
            data.release()

    # -- comparison and display --
    def __eq__(self, other):
        if isinstance(other, _core.PackedView):
            same = self._equal_items(other)
            if same is not None:
                return same
            return all(a == b for a, b in zip(self, other))
        if isinstance(other, (list, tuple)):
            return len(self) == len(other) and all(a == b for a, b in zip(self, other))
        return NotImplemented

    __hash__ = None   # equality by value, like list

    # -- the rest of a read-only list's methods. Not a registered
    #    collections.abc.Sequence, as NumPy arrays and pandas Series are not:
    #    torch's pin_memory and default_convert rebuild a Sequence in a batch as
    #    type(x)([...]) (a new segment, a full copy, for every batch) and
    #    default_collate would make a PackedArray of the collated tensors (read
    #    back unpinned, each a fresh copy). As it is the first two pass the
    #    arrays through and default_collate refuses a field of them, as it
    #    refuses a NumPy array of str. --
    def __reversed__(self):
        return iter(self[::-1])

    def index(self, value, start=0, stop=None) -> int:
        """The first position of `value` at or after `start` and before `stop`
        (bounds as list.index takes them); ValueError if it is not there."""
        first, last, _ = slice(start, stop).indices(len(self))
        position = self._find(value, first, last)    # in C, as `in` looks
        if position < 0:
            raise ValueError(f"{value!r} is not in {type(self).__name__}")
        return position

    def count(self, value) -> int:
        """How many items equal `value`, as list.count counts them."""
        n, found, position = len(self), 0, self._find(value, 0, len(self))
        while position >= 0:
            found += 1
            position = self._find(value, position + 1, n)
        return found

    def __repr__(self):
        n = len(self)
        if n <= 6:
            body = ", ".join(repr(x) for x in self)
        else:
            body = ", ".join([repr(x) for x in self[:3]] + ["..."] +
                             [repr(x) for x in self[-2:]])
        return f"{type(self).__name__}([{body}], len={n})"


class PackedStringArray(_PackedBase):
    """An immutable sequence of str stored as UTF-8 in one shared segment.

    ``PackedStringArray(items, *, sharing_strategy="file_descriptor")`` takes a
    list, tuple, any iterable (consumed as it goes: a generator never becomes a
    list), a 1-d NumPy array of str/object/StringDType, or a pandas Series.
    Also: ``from_file(path)`` (one item per line), ``from_directory(root,
    suffixes=...)`` and ``load(path)``.

    ``a[i]`` returns a str (negative indices work), ``a[i:j:k]`` a view sharing the
    segment; ``len``, iteration, ``reversed``, ``in``, ``.index()``, ``.count()``,
    ``==`` (with another packed array, a list or a tuple), ``.nbytes``,
    ``.tolist()``, ``.take(indices)``, ``.save(path)``. Not a registered
    ``collections.abc.Sequence`` (as a NumPy array is not): torch's pin_memory
    passes it through rather than copy it for every batch, and ``random.sample``
    wants ``range(len(a))`` (then ``a.take(...)``).
    ``__getitems__(indices)`` (the same as take) lets torch's fetcher read a batch in
    one C call: ``[a[i] for i in indices]``, with the same items and errors.
    Strings are encoded with ``surrogateescape``, so file names that are not valid
    UTF-8 round-trip exactly as ``os.listdir`` returns them.
    """

    __slots__ = ()
    _KIND = _core.PACKED_STR

    @classmethod
    def from_iterable(cls, items: Iterable[str], *,
                      sharing_strategy: str = _DEFAULT_STRATEGY) -> "PackedStringArray":
        return cls(items, sharing_strategy=sharing_strategy)

    @classmethod
    def from_file(cls, path, *, encoding: str = "utf-8",
                  sharing_strategy: str = _DEFAULT_STRATEGY) -> "PackedStringArray":
        """One item per line; "\\n" or "\\r\\n" line ends are stripped, a final
        newline adds no empty item, empty lines in between are empty items. UTF-8
        (the fast path, in C: invalid bytes raise ValueError naming the line) or
        any other encoding Python knows."""
        path = os.fspath(path)
        if encoding.lower().replace("_", "-") in ("utf-8", "utf8"):
            def fill(w):
                with open(path, "rb") as f:
                    buf = bytearray(_READ_CHUNK)
                    view = memoryview(buf)
                    while True:
                        n = f.readinto(buf)
                        if not n:
                            break
                        w.feed_lines(view[:n])
                    view.release()
                    w.feed_lines(b"", final=True)
        else:
            def fill(w):
                with open(path, encoding=encoding, newline="\n") as f:
                    w.extend(_strip_newline(line) for line in _lines(f))
        return _build(cls, fill, sharing_strategy)

    @classmethod
    def from_directory(cls, root, suffixes: Union[str, Iterable[str], None] = None, *,
                       follow_symlinks: bool = True,
                       sharing_strategy: str = _DEFAULT_STRATEGY) -> "PackedStringArray":
        """Paths, relative to `root`, of the regular files below it whose names end
        with one of `suffixes` (ignoring ASCII case; None: every file), sorted
        bytewise (code point order for UTF-8 names). Scanned in C without the GIL.
        Symbolic links count as what they point to (dangling ones are skipped);
        linked directories are entered with follow_symlinks (default, as torchvision's
        ImageFolder) but never twice on one path."""
        root = os.fspath(root)
        root_b = os.fsencode(root)
        suffix_t = _suffix_tuple(suffixes)
        try:
            # Ctrl-C is looked for in the main thread, the one that runs handlers
            main = threading.current_thread() is threading.main_thread()
            return _build(cls, lambda w: _core.packed_scan(w, root_b, b"", suffix_t,
                                                            follow_symlinks, main),
                          sharing_strategy)
        except OSError as exc:
            # the C scan works on bytes; name the path as the caller spelt it (os.* do)
            if isinstance(root, str) and isinstance(exc.filename, bytes):
                exc.filename = os.fsdecode(exc.filename)
            raise


class PackedArray(_PackedBase):
    """An immutable sequence of arbitrary picklable records (e.g. COCO annotation
    dicts), each pickled into one shared segment. ``a[i]`` unpickles a fresh object
    every time: changing it changes nothing stored. Same API as PackedStringArray
    (``PackedArray(items)``, views, ``load``/``save``, sharing); ``==`` compares the
    records. ``PackedArray.load`` is the only way to read pickled records from a
    file: load only files you trust."""

    __slots__ = ()
    _KIND = _core.PACKED_PICKLE

    @classmethod
    def load(cls, path, *, sharing_strategy: str = _DEFAULT_STRATEGY, populate: bool = False):
        """Memory-map a file of pickled records written by save(). Unsafe for files
        you do not trust: every record read is unpickled, and unpickling can run any
        code the file's author chose. (PackedStringArray.load never unpickles.)

        Do not truncate or rewrite a loaded file of yours in place (a
        process reading it would die of SIGBUS); replace it by renaming a
        new file over it, as save() does. A file another user could change
        is copied at load instead (see the module's docstring).

        O(1) where it is mapped: the header is checked now, every item when it is
        read. populate=True maps every page now (see PackedStringArray.load); a
        copy is populated anyway."""
        return _load(cls, path, sharing_strategy, populate)

    @classmethod
    def from_iterable(cls, items: Iterable[Any], *,
                      sharing_strategy: str = _DEFAULT_STRATEGY) -> "PackedArray":
        return cls(items, sharing_strategy=sharing_strategy)


_CLASSES = {_core.PACKED_STR: PackedStringArray, _core.PACKED_PICKLE: PackedArray}


def _lines(f: io.TextIOBase):
    yield from f


def _strip_newline(line: str) -> str:
    if line.endswith("\n"):
        line = line[:-1]
    if line.endswith("\r"):
        line = line[:-1]
    return line


def _suffix_tuple(suffixes):
    if suffixes is None:
        return None
    if isinstance(suffixes, (str, bytes)):
        suffixes = (suffixes,)
    return tuple(os.fsencode(s).lower() for s in suffixes)


def _fsync_directory(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _refuse_kind(path, cls, kind) -> None:
    """Raise unless a file whose header says `kind` may be read as `cls` (None:
    the generic load(), which reads strings only)."""
    if cls is PackedArray:
        if kind == _core.PACKED_STR:
            raise PackedFormatError(f"{path}: holds strings, not pickled records "
                                    "(use PackedStringArray.load)")
        return
    if kind == _core.PACKED_PICKLE:
        if cls is None:
            raise PackedFormatError(
                f"{path}: holds pickled records (a PackedArray file); "
                "fastloader.packed.load reads only strings, because reading a pickled "
                "record runs code chosen by the file's author. If you trust this file, "
                "load it with fastloader.PackedArray.load(path).")
        raise PackedFormatError(f"{path}: holds pickled records, not strings: refused "
                                "(PackedStringArray.load never unpickles)")


def _load(cls, path, sharing_strategy, populate):
    _check_strategy(sharing_strategy)
    path = os.fspath(path)
    opened = _open_regular(path, os.O_RDONLY | os.O_CLOEXEC)
    if opened is None:
        raise PackedFormatError(f"{path}: not a regular file")
    fd, st = opened
    try:
        if st.st_size < _core.PACKED_HEADER_SIZE:
            raise PackedFormatError(f"{path}: fastloader: packed array: truncated: "
                                    f"{st.st_size} bytes, shorter than the "
                                    f"{_core.PACKED_HEADER_SIZE}-byte header")
    except BaseException:
        os.close(fd)
        raise
    if _others_can_shorten(fd, st):
        try:
            seg = _copy_in(fd, st.st_size, sharing_strategy, path)
        finally:
            os.close(fd)
    else:
        by_fd = sharing_strategy == "file_descriptor"
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        try:
            seg = _Segment("file", sharing_strategy, fd, st.st_size,
                           path=os.path.abspath(path), ident=ident, populate=populate,
                           keep_fd=by_fd)
        except BaseException:
            os.close(fd)
            raise
    target = None if cls in (None, _PackedBase) else cls
    _refuse_kind(path, target, _header_kind(seg.mapping))
    try:
        # the type's kind is checked again in C against the header it validates
        # (the file may change between the two reads)
        return _core.PackedView.__new__(target or PackedStringArray, seg, seg.mapping)
    except ValueError as exc:
        raise PackedFormatError(f"{path}: {exc}") from None


def _others_can_shorten(fd: int, st) -> bool:
    """Whether another user could cut this file short while it is mapped: one who owns
    it (root aside: root can do anything to this process anyway), or any, where others
    may write it, or where the group bits allow writing, unless they are those of our
    own user private group (umask 002 makes every file of ours group-writable) and no
    POSIX ACL grants anyone else (its grants show in the group bits). A mapped page
    past a file's new end kills its reader with SIGBUS, which no check can prevent,
    so such a file is copied, not mapped."""
    if st.st_uid not in (os.geteuid(), 0) or st.st_mode & stat.S_IWOTH:
        return True
    if not st.st_mode & stat.S_IWGRP:
        return False
    return _has_acl(fd) or not _our_private_group(st.st_gid)


def _has_acl(fd: int) -> bool:
    try:
        names = os.listxattr(fd)
    except OSError:   # no extended attributes here: no ACL either
        return False
    return any(n in ("system.posix_acl_access", "system.nfs4_acl") for n in names)


def _our_private_group(gid: int) -> bool:
    """Whether `gid` is our user's private group: named as we are, no other member,
    nobody else's primary group."""
    import grp
    import pwd

    try:
        me = pwd.getpwuid(os.geteuid())
        group = grp.getgrgid(gid)
    except (KeyError, OSError):
        return False
    if group.gr_name != me.pw_name or any(m != me.pw_name for m in group.gr_mem):
        return False
    return not any(u.pw_gid == gid and u.pw_uid != me.pw_uid for u in pwd.getpwall())


def _copy_in(src: int, size: int, strategy: str, path: str) -> _Segment:
    """A private, sealed copy of the file open at `src`, as a segment of `strategy`.
    Read by the kernel (sendfile), not through a mapping: a file cut short meanwhile
    gives a short read, reported, never a SIGBUS."""
    kind, fd, name = _new_segment(strategy)
    try:
        _reserve(fd, size)
        done = 0
        while done < size:
            try:
                sent = os.sendfile(fd, src, done, size - done)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.ENOSYS):
                    raise
                # a file system that cannot splice: read and write instead
                chunk = os.pread(src, min(size - done, 1 << 24), done)
                sent = os.write(fd, chunk) if chunk else 0
            if sent == 0:
                raise PackedFormatError(f"{path}: truncated while it was loaded: "
                                        f"{done} of {size} bytes")
            done += sent
        return _finish_segment(kind, fd, name, size, strategy)
    except BaseException:
        _discard(fd, name)
        raise


def _header_kind(mapping) -> int:
    with memoryview(mapping) as m:
        return int.from_bytes(m[12:16], "little") if len(m) >= 16 else 0


def load(path, *, sharing_strategy: str = _DEFAULT_STRATEGY, populate: bool = False):
    """Load a file of strings written by ``save()``: the same as
    ``PackedStringArray.load(path)``. A file of pickled records is refused with
    PackedFormatError (reading one runs code chosen by its author): if you trust
    the file, use ``PackedArray.load(path)``.

    Do not truncate or rewrite a loaded file of yours in place (a process reading it
    would die of SIGBUS); replace it by renaming a new file over it, as save() does. A
    file another user could change is copied at load instead (see the module's
    docstring).
    """
    return _load(None, path, sharing_strategy, populate)
