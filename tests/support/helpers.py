"""Helpers shared by the fastloader tests (comparison, deadlines, process/fd probes)."""
import collections
import ctypes
import collections.abc
import contextlib
import gc
import glob
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

import numpy as np
import psutil
import torch

from fastloader import _core, reaper
from fastloader.sharing import NAME_ROOT, parse_segment_name, pid_namespace

SHM_GLOB = f"/dev/shm/{NAME_ROOT}-*"


# ---- comparing batches --------------------------------------------------------------

def assert_same_batches(a, b, path="batch", exact=()):
    """Assert that two (nested) values are identical: same types at every level
    (``type(x) is type(y)``, so namedtuple vs tuple or np.float64 vs float count),
    same dtypes, shapes, devices and values, same key order, and for mappings and
    other objects the same attributes (dict subclasses' ``__dict__``, defaultdict
    factories). Instances of the types in ``exact`` are compared with ``==``."""
    if isinstance(a, exact) or isinstance(b, exact):
        assert a == b, f"{path}: {a!r} != {b!r}"
        return
    assert type(a) is type(b), f"{path}: type {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert a.device == b.device, f"{path}: device {a.device} != {b.device}"
        assert torch.equal(a, b), f"{path}: values differ\n{a}\n!=\n{b}"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        # object arrays hold Python values: compare those, not their identities
        same = a.tolist() == b.tolist() if a.dtype == object else np.array_equal(a, b)
        assert same, f"{path}: values differ\n{a!r}\n!=\n{b!r}"
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype, f"{path}: dtype {a.dtype} != {b.dtype}"
        assert a == b, f"{path}: {a!r} != {b!r}"
    elif isinstance(a, collections.abc.Mapping):
        assert list(a.keys()) == list(b.keys()), f"{path}: keys {list(a)} != {list(b)}"
        for key in a:
            assert_same_batches(a[key], b[key], f"{path}[{key!r}]", exact)
        if isinstance(a, collections.defaultdict):
            assert a.default_factory is b.default_factory, f"{path}: default_factory"
        if hasattr(a, "__dict__"):
            assert_same_batches(vars(a), vars(b), f"{path}.__dict__", exact)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}\n{a!r}\n{b!r}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_batches(x, y, f"{path}[{i}]", exact)
    elif isinstance(a, (str, bytes, int, float, complex, type(None), range, type)):
        assert a == b, f"{path}: {a!r} != {b!r}"
    elif hasattr(a, "__dict__"):
        assert_same_batches(vars(a), vars(b), f"{path}.__dict__", exact)
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_same_batch_lists(expected, got, what=""):
    assert len(got) == len(expected), f"{what}: {len(got)} batches, expected {len(expected)}"
    for i, (e, g) in enumerate(zip(expected, got)):
        assert_same_batches(g, e, f"{what} batch {i}")


def clone_batch(obj):
    """Deep copy into private memory (so cached references hold no shm, fds or slots)."""
    if isinstance(obj, torch.Tensor):
        return obj.clone()
    if isinstance(obj, np.ndarray):
        return obj.copy()
    if isinstance(obj, dict):
        return type(obj)((k, clone_batch(v)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(clone_batch(v) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_batch(v) for v in obj)
    if hasattr(obj, "__dict__") and not isinstance(obj, type):
        new = object.__new__(type(obj))
        new.__dict__.update({k: clone_batch(v) for k, v in vars(obj).items()})
        return new
    return obj


def iter_tensors(obj):
    """Every tensor inside a nested batch."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from iter_tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from iter_tensors(v)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from iter_tensors(v)


def tensor_span(t):
    """[start, end) of the bytes a tensor's elements occupy."""
    start = t.data_ptr()
    if t.numel() == 0:
        return start, start
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()) if size > 0)
    return start, start + (last + 1) * t.element_size()


def span_in_segments(span, segments):
    start, end = span
    return any(addr <= start and end <= addr + nbytes for addr, nbytes in segments)


RING_SEGMENTS = ("memfd:fastloader", "/dev/shm/fastloader-")
TORCH_SEGMENTS = ("/dev/shm/torch_",)   # torch's per-storage segments (unlinked)


def ring_bytes(kinds=RING_SEGMENTS):
    """Memory of the shared-memory segments this process maps whose path starts
    with (or, for a memfd, holds) one of `kinds` (default: the ring's, memfd or
    /dev/shm files): the pages each holds (st_blocks; the main process touches only
    the bytes it reads, so its RSS does not show them), each segment once."""
    held = {}
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split(maxsplit=5)
            path = parts[5].strip() if len(parts) > 5 else ""
            if not any(path.startswith(k) or (k.startswith("memfd:") and k in path)
                       for k in kinds):
                continue
            st = os.stat(f"/proc/self/map_files/{parts[0]}")   # root, as the suite runs
            held[st.st_dev, st.st_ino] = st.st_blocks * 512
    return sum(held.values())


# The decoder's rule (csrc/codec.c, FL_COPY_OUT_*): in a batch of at least 16 KiB of
# data, a storage of at most 1/256 of it and 64 KiB is always copied out of the slot
# (so that keeping it does not keep the slot), and one of at most 1/16 while the
# copies together stay within 1/16 of the data. Both tiers lie within the 1/16 share,
# which is the bound may_be_copied_out() checks.
COPY_OUT_SHARE, COPY_OUT_FLOOR = 16, 16384


def may_be_copied_out(t, batch):
    """Whether the decoder may have copied tensor `t` of `batch` out of its slot: an
    upper bound on its batch's data area (every tensor's storage bytes, each block
    padded to 64) against the rule above."""
    storages = {}
    for x in iter_tensors(batch):
        s = x.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
    data = sum(n + 64 for n in storages.values())
    return data >= COPY_OUT_FLOOR and t.untyped_storage().nbytes() * COPY_OUT_SHARE <= data


# ---- never hang ---------------------------------------------------------------------

class DeadlineExceeded(BaseException):
    """Raised by `deadline` (a BaseException so no loader code swallows or wraps it)."""


def describe_children():
    """Where every child process of this one is: its state, kernel wait channel and
    system call (from /proc), and its threads' native stacks where gdb is installed.
    For hangs: the main process's own stack is in the test's traceback already."""
    lines = []
    gdb = shutil.which("gdb")
    for child in psutil.Process().children(recursive=True):
        try:
            lines.append(f"--- child {child.pid} {child.name()} {child.status()} "
                         f"cmdline {' '.join(child.cmdline())[:200]}")
        except psutil.Error as error:
            lines.append(f"--- child {child.pid}: {error!r}")
            continue
        for what in ("wchan", "syscall"):
            try:
                with open(f"/proc/{child.pid}/{what}") as f:
                    lines.append(f"    {what}: {f.read().strip()}")
            except OSError as error:
                lines.append(f"    {what}: {error!r}")
        if gdb:
            try:
                out = subprocess.run([gdb, "-p", str(child.pid), "-batch", "-ex",
                                      "thread apply all bt 30"], capture_output=True, text=True,
                                     timeout=30).stdout
            except (OSError, subprocess.SubprocessError) as error:
                out = repr(error)
            lines.extend("    " + line for line in out.splitlines()
                         if line.startswith(("#", "Thread")))
    return "\n".join(lines) or "no child processes"


@contextlib.contextmanager
def deadline(seconds, what="loader"):
    """Interrupt the main thread with DeadlineExceeded after `seconds` (SIGALRM).

    fastloader waits in C with signals checked, so a hang becomes a test failure
    instead of a stuck suite; faulthandler_timeout is the backstop if even that fails.
    Interval timers are not inherited across fork, so workers are unaffected."""
    def on_alarm(signum, frame):
        # a hang's cause is usually in a worker: say where each child is stuck
        print(describe_children(), file=sys.stderr, flush=True)
        raise DeadlineExceeded(f"{what}: still running after {seconds} s (hang?)")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def collect(loader, seconds=60, what="loader"):
    with deadline(seconds, what):
        iterator = iter(loader)
        try:
            return list(iterator)
        except BaseException:
            _shut_down_torchs(iterator)
            raise


def _shut_down_torchs(iterator):
    """Stop the workers of torch's iterator that has just raised, as its __del__ would
    if the iterator were freed now.

    The exception's traceback holds the iterator in a reference cycle, so only the
    garbage collector frees it, and the collector runs weakref callbacks before
    __del__: the index queues' finalizers stop their feeder threads first, the None
    that tells each worker to exit is never sent, and torch's shutdown waits its 5 s
    per worker before terminating them. A reference run then cost a test 5-10 s (290 s
    of the suite's time)."""
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


# ---- processes, fds, mappings, /dev/shm -------------------------------------------

def unused_pid(long_unused=False):
    """A pid no process has now, and the last one the kernel would hand out: pids
    are given upwards from the last one given, wrapping at pid_max, so the free pid
    just below it is reached last (one near pid_max may be the very next, once the
    counter is near the top after many processes).

    long_unused: one half the range behind instead, given about as many processes
    ago as it will be given again (minutes of a busy test run either way): a pid
    given moments ago may be a killed loader's of another test, whose leftover
    segments a sweep rightly takes."""
    with open("/proc/sys/kernel/pid_max") as f:
        pid_max = int(f.read())
    with open("/proc/sys/kernel/ns_last_pid") as f:
        last = int(f.read())
    first_back = pid_max // 2 if long_unused else 1
    for back in range(first_back, first_back + pid_max):
        pid = (last - back) % pid_max
        if pid > 300 and not os.path.exists(f"/proc/{pid}"):
            return pid
    raise RuntimeError("no free pid")


def in_forked_child(fn):
    """fn()'s result as computed in a forked child of this process (pickled back);
    an exception in the child fails the caller with its type and text."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            data = pickle.dumps(fn())
        except BaseException as exc:   # reported to the caller, below
            data, code = pickle.dumps(f"{type(exc).__name__}: {exc}"), 1
        with os.fdopen(w, "wb") as f:
            f.write(data)
        os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    result = pickle.loads(data)
    assert os.waitstatus_to_exitcode(status) == 0, f"in the forked child: {result}"
    return result


def run_python(code, timeout):
    """Run `code` in a fresh interpreter (this one's environment); its finished
    process (text output), which must have exited 0."""
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    return run


_HELPER_MARKERS = ("multiprocessing.forkserver", "multiprocessing.resource_tracker",
                   "multiprocessing.semaphore_tracker")


def _is_helper(proc):
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return False
    return any(marker in cmdline for marker in _HELPER_MARKERS)


def loader_children():
    """pids of our descendants, minus the long-lived multiprocessing helpers
    (forkserver server, resource tracker) that outlive every loader by design.
    Workers forked by the forkserver are included."""
    me = psutil.Process()
    result = set()
    for child in me.children():
        if _is_helper(child):
            try:
                result.update(p.pid for p in child.children(recursive=True))
            except psutil.Error:
                pass
        else:
            result.add(child.pid)
            try:
                result.update(p.pid for p in child.children(recursive=True))
            except psutil.Error:
                pass
    return result


def is_gone(pid):
    """True when pid no longer runs (exited and reaped, or a zombie of another parent)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def is_reaped(pid):
    """True when pid is not (even as a zombie) a child of this process."""
    return pid not in {p.pid for p in psutil.Process().children()} and is_gone(pid)


def wait_until(predicate, timeout, interval=0.05):
    end = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if time.monotonic() >= end:
            return False
        time.sleep(interval)


def release_free_heap_pages():
    """Collect garbage and hand the C heap's free pages back to the system; call it
    before forking workers whose USS a test measures.

    A page the main process writes after a fork is copied for it, and the worker is
    left as the only holder of the old one, which then counts in the worker's USS as
    if the worker had copied it. The main process's allocations during an epoch
    (index lists, batches) reuse free chunks of its heap, which still hold pages
    shared at the fork: 2-15 MiB of such pages came out as a packed worker's
    "growth" in 3 runs of 17 (pagemap showed that the main process, not the worker,
    had replaced them; CI failed on one). Without pages in the free chunks, reusing
    them faults in new pages of the main process's own."""
    gc.collect()
    trim = getattr(ctypes.CDLL(None), "malloc_trim", None)   # glibc only
    if trim is not None:
        trim(0)


def num_fds():
    return psutil.Process().num_fds()


def num_maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def map_lines():
    with open("/proc/self/maps") as f:
        return f.read().splitlines()


@contextlib.contextmanager
def loopback_channels(tag, task_capacity=1 << 16, task_window=0):
    """Both ends of one channel in this process, file_system strategy, under a
    fresh prefix of ours: (main, worker). The main end is closed on exit."""
    prefix = f"{NAME_ROOT}-{os.getpid()}-{uuid.uuid4().hex[:10]}-{tag}"
    main = _core.MainChannel(0, _core.STRATEGY_FS, prefix, task_capacity, 16, task_window)
    h = main.handle()
    try:
        worker = _core.WorkerChannel(h, h["ctl_fd"], h["efd_main"], h["efd_worker"], h["sock"], 3)
        yield main, worker
    finally:
        main.close()


def publish_later(worker, seq, after):
    """Publish batch `seq` ({"seq": seq}) on the worker end `worker` from a thread,
    `after` seconds from now; returns the thread (join it)."""
    def run():
        time.sleep(after)
        worker.publish(_core.RES_BATCH, seq, {"seq": seq})
    t = threading.Thread(target=run)
    t.start()
    return t


def shm_names():
    return set(glob.glob(SHM_GLOB))


def _foreign(path):
    """Best effort on a shared machine: a name embedding the pid of a live process that
    is neither us nor one of our descendants belongs to someone else's session, and
    so does a name of another PID namespace (its pid means nothing to our /proc: a
    test's loader in a namespace of its own, run by another test process). Names
    without a pid, or with a dead pid of ours (a crash leftover), always count."""
    parsed = parse_segment_name(os.path.basename(path))
    if parsed is None:
        return False
    if parsed.namespace is not None and parsed.namespace != pid_namespace():
        return True
    pid = parsed.pid
    if pid == os.getpid() or pid in loader_children() or is_gone(pid):
        return False
    return True


def shm_left(before):
    """fastloader-* entries in /dev/shm now that were not there in `before`."""
    return {p for p in shm_names() - before if not _foreign(p)}


def assert_no_shm_left(before, timeout=5):
    wait_until(lambda: not shm_left(before), timeout)
    left = shm_left(before)
    assert not left, f"left in /dev/shm: {sorted(left)}"


def settle():
    """Drop garbage (iterators in reference cycles) before measuring, and let
    the workers of ended epochs be reaped (their teardown is deferred to
    fastloader's reaper thread, which exits once it has nothing to wait for)."""
    gc.collect()
    reaper.wait_idle(10)


def assert_names_dead_worker(error, worker_id, pid, cause):
    """A worker death is reported as WorkerError (a RuntimeError) naming the worker,
    its pid and the cause (signal name or exit code)."""
    from fastloader import WorkerError

    message = str(error)
    assert isinstance(error, WorkerError) and isinstance(error, RuntimeError), repr(error)
    assert re.search(rf"\bworker {worker_id}\b", message), f"no 'worker {worker_id}': {message}"
    assert re.search(rf"\bpid {pid}\b", message), f"no 'pid {pid}': {message}"
    assert re.search(rf"\b{cause}\b", message), f"no {cause!r}: {message}"
