"""Pinning batches ahead of their turn, on a thread of its own (pin_memory=True).

torch's iterator pins every batch on a pin-memory thread, so the copy into page-locked
memory overlaps the training step. The main process here receives a batch only when
it is due; pinning it then put the copy on the training loop's path (loops 2.0-2.8x
slower than now in `python -m benchmarks.pin_memory_gpu` on an H200). Instead,
each time a batch is handed out, the batches already published in the ring are taken
too (iterator.py) and given to this thread, which pins them while the loop works on
the one before. A batch not taken ahead is pinned when due, as before.

The thread only pins: the ring, the order and the resume bookkeeping stay with the
main thread. One per epoch (iterator._reset closes the last one), so a result can
never answer a later epoch's batch of the same number.
"""
import heapq
import threading
import time

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data._utils import pin_memory as _pin

# how long the main thread sleeps at a time while its batch is being pinned, so that
# Ctrl-C and a dead thread are noticed
_WAIT_SLICE_S = 0.1
# close() waits this long for a copy under way (milliseconds, normally; on a
# failure it does not wait): a copy stuck in the driver must not hold up the loop;
# the thread then ends on its own once it is done, and drops its result
_CLOSE_WAIT_S = 2.0


def _device_index():
    """The accelerator device the main thread uses now (the pinned memory is that
    device's, as torch's pin thread does); None where torch cannot say."""
    acc = getattr(torch, "accelerator", None)
    try:
        if acc is not None and hasattr(acc, "current_device_index"):
            return acc.current_device_index()
        return torch.cuda.current_device()
    except Exception:
        return None


def ask_device_before_accelerator(device):
    """What torch before torch.accelerator (2.5 and older) does as its multiprocessing
    iterator is made with pinning on: it asks the pinning device's current index in
    the main thread, which raises (no driver, say) from iter(). The same call, for
    the same error."""
    if device == "xpu":
        torch.xpu.current_device()
    elif device == torch._C._get_privateuse1_backend_name():
        getattr(torch, device).current_device()
    else:
        torch.cuda.current_device()   # torch's default


def _set_device_index(index):
    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "set_device_index"):
        acc.set_device_index(index)
    else:
        torch.cuda.set_device(index)


def pinned(data, device, device_index=None):
    """`data` pinned, or the error as torch's pin thread reports it: the same error
    whether the batch was pinned ahead or at its turn."""
    try:
        return _pin.pin_memory(data, device)
    except Exception:
        index = device_index if device_index is not None else _device_index()
        return ExceptionWrapper(where=f"in pin memory thread for device {index}")


# what the iterator keeps in place of a batch given to the thread: the iterator
# keeps no reference to the unpinned batch, so once it is pinned its ring slot goes
# back to its worker without waiting for the batch's turn (unless the pinned batch
# still holds part of it: a leaf pin_memory() returns as it is, a NumPy array say)
PINNED_AHEAD = object()


class PinAhead:
    def __init__(self, device, on_wait):
        self._device = device                  # the pin_memory device argument
        self._on_wait = on_wait                # gets the seconds each take() slept
        # read when the thread starts, mid-epoch: asking CUDA for it initialises
        # CUDA, which must not happen before this epoch's workers are forked
        self._device_index = None
        # the copy runs with the main thread's intra-op threads, as it did when the
        # main thread pinned: torch's pin thread copies with one, which made a
        # 38.5 MB float batch's pinning the loop's bottleneck on an H200 box (a
        # new thread would start with OpenMP's default, not the user's setting)
        self._threads = torch.get_num_threads()
        self._cond = threading.Condition()
        # (seq, data), a heap: the batch due first is pinned first (they are taken
        # ahead in the order the workers' rings are read, not their turns')
        self._jobs = []
        self._done = {}                        # seq -> pinned data or ExceptionWrapper
        self._at_turn = set()                  # seqs given at their turn, not ahead
        self._closed = False
        self._thread = None

    def give(self, seq, data):
        """Pin `data`, batch `seq`, on the thread: returns what stands in for it
        until take() (the batch itself once closed)."""
        with self._cond:
            if self._closed:
                return data
            if self._thread is None:
                self._device_index = _device_index()
                self._thread = threading.Thread(target=self._run, name="fastloader_pin",
                                                daemon=True)
                self._thread.start()
            heapq.heappush(self._jobs, (seq, data))   # seqs are unique: data is never compared
            self._cond.notify_all()
        return PINNED_AHEAD

    def take(self, seq, data, timeout=None, since=None):
        """Batch `seq` pinned (or an ExceptionWrapper): the thread's result if it was
        given (`data` is PINNED_AHEAD), else pinned here. TimeoutError after
        `timeout` seconds (None: no limit) from `since` (a perf_counter() time; None:
        now) without the thread's result; the result stays for a later take()."""
        if data is not PINNED_AHEAD and (timeout is None
                                         or not self._pin_on_thread_at_turn(seq, data)):
            return pinned(data, self._device)
        with self._cond:
            if seq in self._done:
                self._at_turn.discard(seq)
                return self._done.pop(seq)
            # a data stall like any other (stats.py): timed only when it sleeps
            started = time.perf_counter()
            try:
                deadline = None if timeout is None else (
                    (started if since is None else since) + timeout)
                result = self._wait_for(seq, deadline)
                self._at_turn.discard(seq)
                return result
            finally:
                self._on_wait(time.perf_counter() - started)

    def at_turn(self, seq, data, timeout):
        """Batch `seq` is due (call before the batches behind it are given: the
        thread takes the lowest seq first, so it is pinned before them, as torch's
        thread pins batches in the order they came). With a timeout, it is pinned on
        the thread, so that take()'s timeout covers its pinning."""
        if timeout is not None and data is not PINNED_AHEAD:
            self._pin_on_thread_at_turn(seq, data)

    def _pin_on_thread_at_turn(self, seq, data) -> bool:
        """With a timeout, a batch that was not given ahead is pinned on the thread
        too, so that the timeout covers its pinning, as torch's covers it (its loop
        waits for its pin thread with the timeout). A take() again after a timeout
        finds it given. False once closed."""
        with self._cond:
            if seq in self._at_turn:
                return True
            if self.give(seq, data) is not PINNED_AHEAD:
                return False
            self._at_turn.add(seq)
            return True

    def _wait_for(self, seq, deadline):
        # called with self._cond held
        while seq not in self._done:
            if self._closed:
                raise RuntimeError(f"fastloader: batch {seq} was dropped with its "
                                   "epoch's pin-memory thread")
            if not self._thread.is_alive():
                raise RuntimeError("fastloader: the pin-memory thread exited unexpectedly")
            wait = _WAIT_SLICE_S
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(seq)
                wait = min(wait, left)
            self._cond.wait(wait)
        return self._done.pop(seq)

    def close(self, wait=True):
        """Drop what is left and end the thread: at once, or once the copy under
        way, if any, is done (`wait`; at most _CLOSE_WAIT_S)."""
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._done.clear()
            self._at_turn.clear()
            self._cond.notify_all()
            thread = self._thread
        if wait and thread is not None and thread is not threading.current_thread():
            thread.join(_CLOSE_WAIT_S)

    def _run(self):
        try:
            torch.set_num_threads(self._threads)
            if self._device_index is not None:
                _set_device_index(self._device_index)
            failed = None
        except Exception:
            # each batch's turn raises it (torch's thread dies, and the loop gets
            # "Pin memory thread exited unexpectedly" without the cause)
            failed = ExceptionWrapper(where=f"in pin memory thread for device "
                                            f"{self._device_index}")
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                seq, data = heapq.heappop(self._jobs)
            data = failed or pinned(data, self._device, self._device_index)
            with self._cond:
                if not self._closed:
                    self._done[seq] = data
                    self._cond.notify_all()
            del data
