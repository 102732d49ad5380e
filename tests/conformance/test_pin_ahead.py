"""pin_memory=True: batches published ahead of their turn are pinned on a thread while
the loop works on the batch before (pin_ahead.py), and the loop sees what torch's
DataLoader gives it, errors included.

CI has no accelerator, so pinning is played: torch.accelerator answers as a one-device
machine would and Tensor.pin_memory returns a copy and records which thread made it.
torch's own pin_memory() walks the batch, in both loaders. The real pinning was checked
on an H200 (tests/conformance/test_conformance.py's accelerator tests and the
issue's note)."""
import contextlib
import os
import signal
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.utils.data

import fastloader
from tests.support import conformance_datasets as cds
from tests.support import resume_datasets as rd
from tests.support.helpers import assert_same_batch_lists, clone_batch
from tests.support.torch_features import needs_accelerator_api

# pinning is played through torch.accelerator (torch 2.6)
pytestmark = [needs_accelerator_api]

PIN_THREAD = "fastloader_pin"


class _PlayedPinning:
    def __init__(self, fail_at=None):
        self.threads = []          # (first value of the tensor, thread name) per pin
        self.fail_at = fail_at     # a batch whose first value makes the pin fail

    def pin(self, tensor):
        first = int(tensor.flatten()[0]) if tensor.numel() else None
        self.threads.append((first, threading.current_thread().name))
        if self.fail_at is not None and first == self.fail_at:
            raise ValueError(f"played pinning failed at {first}")
        copy = tensor.clone()
        copy.played_pinned = True
        return copy


@pytest.fixture
def pinning(monkeypatch):
    played = _PlayedPinning()
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index", lambda index: None)
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: played.pin(self))
    return played


def _pin_threads_alive():
    return [t for t in threading.enumerate() if t.name == PIN_THREAD]


def _run(DL, *, n=48, batch_size=4, step_s=0.02, persistent=False, stop_after=None,
         in_order=True):
    """The loop's view: each batch (or the error its next() raised, as text), with
    `step_s` of "training" per batch so that the workers publish ahead; out of
    order, each epoch's sorted."""
    loader = DL(cds.IndexDataset(n=n), batch_size=batch_size, num_workers=2,
                pin_memory=True, persistent_workers=persistent, in_order=in_order,
                multiprocessing_context="fork")
    epochs = []
    for stop in (stop_after, None):
        seen = []
        it = iter(loader)
        while stop is None or len(seen) < stop:
            try:
                batch = next(it)
            except StopIteration:
                break
            except Exception as e:   # the loop goes on past a failed batch, as torch's does
                seen.append(("error", type(e).__name__, str(e).splitlines()[0]))
                continue
            assert getattr(batch, "played_pinned", False), "a batch was not pinned"
            seen.append(batch.tolist())
            time.sleep(step_s)
        del it
        epochs.append(seen if in_order else sorted(seen, key=repr))
    return epochs


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("persistent", [False, True])
def test_batches_published_ahead_are_pinned_on_the_pin_thread(pinning, persistent,
                                                              in_order):
    ours = _run(fastloader.DataLoader, persistent=persistent, in_order=in_order)
    on_thread = [first for first, name in pinning.threads if name == PIN_THREAD]
    pinning.threads.clear()
    theirs = _run(torch.utils.data.DataLoader, persistent=persistent, in_order=in_order)
    assert ours == theirs
    # 24 batches, each 20 ms of "training" behind the workers: nearly all arrive
    # before their turn (before the fixes, every one was pinned on the main thread,
    # in order at its turn, out of order as it was handed out)
    assert len(on_thread) >= 12, pinning.threads
    assert not _pin_threads_alive()


@pytest.mark.parametrize("step_s", [0.0, 0.02])
def test_a_failed_pin_is_raised_at_its_batch_as_torchs_is(pinning, step_s):
    pinning.fail_at = 20    # batch 5 (indices 20..23) of 12
    ours = _run(fastloader.DataLoader, step_s=step_s)
    pinning.threads.clear()
    theirs = _run(torch.utils.data.DataLoader, step_s=step_s)
    assert ours == theirs
    assert ("error", "ValueError", "Caught ValueError in pin memory thread for device 0.") \
        in ours[1]


@pytest.mark.parametrize("persistent", [False, True])
def test_an_epoch_broken_off_leaves_no_pinned_batch_for_the_next(pinning, persistent):
    # the first epoch stops after 2 batches with more already pinned ahead; the next
    # epoch's batch numbers start at 0 again and must get that epoch's own batches
    ours = _run(fastloader.DataLoader, persistent=persistent, stop_after=2, step_s=0.05)
    pinning.threads.clear()
    theirs = _run(torch.utils.data.DataLoader, persistent=persistent, stop_after=2,
                  step_s=0.05)
    assert ours == theirs
    assert len(ours[0]) == 2 and len(ours[1]) == 12
    deadline = time.monotonic() + 30
    while _pin_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pin_threads_alive()


@pytest.mark.parametrize("interrupt", ["ctrl_c", "timeout"])
def test_out_of_order_a_batch_interrupted_in_its_pinning_is_not_lost(pinning, monkeypatch,
                                                                      interrupt):
    """in_order=False: a Ctrl-C or a timeout while the loop waits for the pin thread
    puts that batch back; after a timeout the loop goes on and gets it, after a
    Ctrl-C a saved state resumes it. Every batch comes exactly once."""
    gate = _gated_pinning(pinning, monkeypatch, 12)   # batch 3: stuck on the pin thread

    def make(seed):
        # batch 2 comes late, so batch 3 is handed out before it (out of order)
        return fastloader.DataLoader(cds.IndexDataset(n=48, delays={8: 1.0}), batch_size=4,
                                     num_workers=2,
                                     pin_memory=True, in_order=False,
                                     timeout=2 if interrupt == "timeout" else 0,
                                     multiprocessing_context="fork",
                                     generator=torch.Generator().manual_seed(seed))

    loader = make(7)
    it = iter(loader)
    head = []

    def loop():
        while True:
            batch = next(it)
            head.append(batch.tolist())
            time.sleep(0.05)   # the training step: later batches are taken ahead

    if interrupt == "ctrl_c":
        with _ctrl_c_in_the_pin_wait(gate):
            loop()
        assert [[i, 10 * i] for i in range(8, 12)] not in head   # 3 came before 2
        state = loader.state_dict()
        del it, loader
        resumed = make(999)
        resumed.load_state_dict(state)
        rest = [b.tolist() for b in resumed]
    else:
        with pytest.raises(RuntimeError, match="DataLoader timed out after 2 seconds"):
            loop()
        assert [[i, 10 * i] for i in range(8, 12)] not in head   # 3 came before 2
        gate.set()
        rest = [b.tolist() for b in it]
    assert [[i, 10 * i] for i in range(12, 16)] not in head
    assert sorted(head + rest) == [[[i, 10 * i] for i in range(b, b + 4)]
                                   for b in range(0, 48, 4)]


@pytest.mark.parametrize("dataset", ["map", "stream"])
@pytest.mark.parametrize("k", [1, 5])
def test_a_state_saved_with_batches_pinned_ahead_resumes_them(pinning, dataset, k):
    """Batches taken ahead and not yet handed out are not yielded: a resume gives them."""
    def make_dataset():
        return rd.RandomAugmented(48) if dataset == "map" else rd.CountingStream(45, True)

    def make(seed):
        return fastloader.DataLoader(make_dataset(), batch_size=4, num_workers=2,
                                     shuffle=dataset == "map", pin_memory=True,
                                     snapshot_every_n_steps=2, multiprocessing_context="fork",
                                     generator=torch.Generator().manual_seed(seed))

    full = [clone_batch(b) for b in make(7)]
    first = make(7)
    it = iter(first)
    head = []
    for _ in range(k):
        head.append(clone_batch(next(it)))
        time.sleep(0.05)   # the workers publish ahead meanwhile
    taken_ahead = [name for _, name in pinning.threads if name == PIN_THREAD]
    state = first.state_dict()
    del it, first
    second = make(999)
    second.load_state_dict(state)
    assert taken_ahead, "no batch was pinned ahead before the stop"
    assert_same_batch_lists(full, head + [clone_batch(b) for b in second], "the epoch")


def _interrupt_once_waiting_for_the_pin_thread(sent):
    """Ctrl-C once the main thread sleeps for a batch the pin thread holds."""
    main = threading.main_thread().ident
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "_wait_for":
                sent.set()
                os.kill(os.getpid(), signal.SIGINT)
                return
            frame = frame.f_back
        time.sleep(0.01)


@contextlib.contextmanager
def _ctrl_c_in_the_pin_wait(gate):
    """The block must raise the KeyboardInterrupt of a Ctrl-C pressed once the main
    thread sleeps for a batch the pin thread holds; `gate` opens afterwards."""
    sent = threading.Event()
    interrupter = threading.Thread(target=_interrupt_once_waiting_for_the_pin_thread,
                                   args=(sent,))
    interrupter.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            yield
    finally:
        interrupter.join()
        gate.set()
    assert sent.is_set()


def test_ctrl_c_while_a_batch_is_being_pinned_stops_the_workers(pinning, monkeypatch):
    gate = threading.Event()
    pin = pinning.pin

    def stuck_pin(tensor):
        if threading.current_thread().name == PIN_THREAD:
            gate.wait(60)   # a copy that does not end: the loop waits for it
        return pin(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: stuck_pin(self))
    loader = fastloader.DataLoader(cds.IndexDataset(n=48), batch_size=4, num_workers=2,
                                   pin_memory=True, multiprocessing_context="fork")
    it = iter(loader)
    pids = list(it.worker_pids)
    with _ctrl_c_in_the_pin_wait(gate):
        for _ in range(12):   # the batches before the one held are pinned here
            next(it)
            time.sleep(0.05)
    with pytest.raises(RuntimeError, match="stopped after KeyboardInterrupt"):
        next(it)
    assert not [p for p in pids if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    del it
    deadline = time.monotonic() + 30
    while _pin_threads_alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pin_threads_alive()


def test_waiting_for_the_pin_thread_counts_as_waiting_for_data(pinning, monkeypatch):
    pin = pinning.pin

    def slow_pin(tensor):
        if threading.current_thread().name == PIN_THREAD:
            time.sleep(0.1)
        return pin(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: slow_pin(self))
    loader = fastloader.DataLoader(cds.IndexDataset(n=48), batch_size=4, num_workers=2,
                                   pin_memory=True, multiprocessing_context="fork")
    assert len(list(loader)) == 12
    on_thread = sum(name == PIN_THREAD for _, name in pinning.threads)
    stats = loader.stats()
    # the loop does nothing but wait: the thread's 0.1 s per batch is its data stall
    # (the workers are far ahead: their own waits are a few milliseconds)
    assert on_thread >= 6, pinning.threads
    assert stats["wait_s"] >= 0.05 * on_thread, (stats["wait_s"], on_thread)


def _gated_pinning(pinning, monkeypatch, value):
    """The pin of the batch whose first value is `value` waits, on a pin thread
    (torch's or ours), until the returned gate opens."""
    gate = threading.Event()
    pin = pinning.pin

    def gated_pin(tensor):
        if (threading.current_thread() is not threading.main_thread()
                and int(tensor.flatten()[0]) == value):
            gate.wait(60)
        return pin(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: gated_pin(self))
    return gate


def _timeout_then_the_rest(it, gate):
    """next() times out while a pinning waits for `gate`; then the gate opens and
    the rest of the epoch comes: [the error's text, batch, ...]."""
    seen = []
    try:
        next(it)
    except RuntimeError as e:
        seen.append(str(e))
    gate.set()
    return seen + [b.tolist() for b in it]


def test_a_timeout_while_a_batch_is_being_pinned_is_torchs_and_loses_nothing(
        pinning, monkeypatch):
    def run(DL):
        gate = _gated_pinning(pinning, monkeypatch, 8)   # batch 2
        # batch 2 comes 0.5 s late: batch 1 is surely pinned before it (torch's
        # thread pins in the order batches arrive)
        loader = DL(cds.IndexDataset(n=24, delays={8: 0.5}), batch_size=4, num_workers=2,
                    pin_memory=True, timeout=1.5, multiprocessing_context="fork")
        it = iter(loader)
        seen = [next(it).tolist()]
        time.sleep(1)   # batch 2 is published before batch 1 is handed out
        seen.append(next(it).tolist())
        return seen + _timeout_then_the_rest(it, gate)

    ours = run(fastloader.DataLoader)
    theirs = run(torch.utils.data.DataLoader)
    assert ours == theirs
    assert ours[2] == "DataLoader timed out after 1.5 seconds" and len(ours) == 7


def test_a_timeout_covers_the_pinning_of_a_batch_pinned_at_its_turn(pinning, monkeypatch):
    """One worker, one batch in flight: nothing is taken ahead, each batch is pinned
    at its turn. torch's loop waits for its pin thread with the timeout; ours pinned
    such a batch on the loop's thread, with no timeout at all."""
    def run(DL):
        gate = _gated_pinning(pinning, monkeypatch, 0)   # batch 0's pinning waits
        loader = DL(cds.IndexDataset(n=8), batch_size=4, num_workers=1, prefetch_factor=1,
                    pin_memory=True, timeout=0.5, multiprocessing_context="fork")
        return _timeout_then_the_rest(iter(loader), gate)

    ours = run(fastloader.DataLoader)
    theirs = run(torch.utils.data.DataLoader)
    assert ours == theirs
    assert ours[0] == "DataLoader timed out after 0.5 seconds" and len(ours) == 3


def test_one_timeout_covers_the_workers_time_and_the_pinning_together(pinning, monkeypatch):
    """torch's loop waits once, with the timeout, for its pin thread's output: a
    batch whose worker takes 0.5 s and whose pinning takes 0.9 s times out at 1 s.
    Ours waited for the worker with the timeout, then for the pinning with a new one
    (up to twice the timeout in all)."""
    pin = pinning.pin

    def slow_pin(tensor):
        if threading.current_thread() is not threading.main_thread() \
                and int(tensor.flatten()[0]) == 0:
            time.sleep(0.9)
        return pin(tensor)

    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self, *a, **k: slow_pin(self))

    def run(DL):
        loader = DL(cds.IndexDataset(n=8, delays={0: 0.5}), batch_size=4, num_workers=1,
                    prefetch_factor=1, pin_memory=True, timeout=1,
                    multiprocessing_context="fork")
        seen = []
        it = iter(loader)
        try:
            next(it)
        except RuntimeError as e:
            seen.append(str(e))
        return seen + [b.tolist() for b in it]

    ours = run(fastloader.DataLoader)
    theirs = run(torch.utils.data.DataLoader)
    assert ours == theirs
    assert ours[0] == "DataLoader timed out after 1 seconds" and len(ours) == 3


@pytest.mark.parametrize("persistent", [False, True])
def test_a_state_saved_after_ctrl_c_while_a_batch_is_pinned_resumes_it(
        pinning, monkeypatch, persistent):
    gate = _gated_pinning(pinning, monkeypatch, 8)   # batch 2

    def make(seed):
        return fastloader.DataLoader(cds.IndexDataset(n=24, delays={8: 0.5}),
                                     batch_size=4, num_workers=2,
                                     pin_memory=True, persistent_workers=persistent,
                                     multiprocessing_context="fork",
                                     generator=torch.Generator().manual_seed(seed))

    loader = make(7)
    it = iter(loader)
    head = [next(it).tolist()]
    time.sleep(1)   # batch 2 is published before batch 1 is handed out
    head.append(next(it).tolist())
    with _ctrl_c_in_the_pin_wait(gate):
        next(it)
    state = loader.state_dict()
    del it, loader
    resumed = make(999)
    resumed.load_state_dict(state)
    rest = [b.tolist() for b in resumed]
    assert head + rest == [[[i, 10 * i] for i in range(b, b + 4)] for b in range(0, 24, 4)]


def test_out_of_order_a_failed_pin_is_raised_as_torchs_is(pinning):
    pinning.fail_at = 20

    def run(DL):
        loader = DL(cds.IndexDataset(n=48), batch_size=4, num_workers=2, pin_memory=True,
                    in_order=False, multiprocessing_context="fork")
        seen, it = [], iter(loader)
        while True:
            try:
                seen.append(repr(next(it).tolist()))
            except StopIteration:
                return sorted(seen)
            except ValueError as e:
                seen.append(str(e).splitlines()[0])

    ours, theirs = run(fastloader.DataLoader), run(torch.utils.data.DataLoader)
    assert ours == theirs
    assert "Caught ValueError in pin memory thread for device 0." in ours


_MAIN_PID = os.getpid()


def _rebuild_tag(value, interrupt_at):
    if os.getpid() == _MAIN_PID and value == interrupt_at:
        os.kill(_MAIN_PID, signal.SIGINT)   # the user's Ctrl-C, as this batch is decoded
        for _ in range(1000):
            pass
    return _Tag(value, None)


class _Tag:
    """Rebuilt in the main process by unpickling: there it can press Ctrl-C."""

    def __init__(self, value, interrupt_at):
        self.value, self.interrupt_at = value, interrupt_at

    def __reduce__(self):
        return _rebuild_tag, (self.value, self.interrupt_at)


def _tagging_collate(interrupt_at):
    def collate(samples):
        batch = torch.stack(samples)
        return {"x": batch, "tag": _Tag(int(batch[0, 0]), interrupt_at)}
    return collate


def test_ctrl_c_while_batches_are_taken_ahead_loses_none_and_stops_the_workers(pinning):
    def make(interrupt_at):
        return fastloader.DataLoader(cds.IndexDataset(n=48), batch_size=4, num_workers=2,
                                     pin_memory=True, multiprocessing_context="fork",
                                     collate_fn=_tagging_collate(interrupt_at))

    loader = make(20)   # batch 5 presses Ctrl-C as the main process decodes it
    it = iter(loader)
    head = []
    with pytest.raises(KeyboardInterrupt) as caught:
        for batch in it:
            head.append(batch["x"][:, 0].tolist())
            time.sleep(0.1)   # the training step: batch 5 arrives before its turn
    where = [f.name for f in caught.traceback]
    assert "_take_ahead" in where, where
    assert it._shutdown, "the workers were not stopped"
    state = loader.state_dict()
    del it, loader
    resumed = make(None)
    resumed.load_state_dict(state)
    rest = [batch["x"][:, 0].tolist() for batch in resumed]
    assert head + rest == [list(range(b, b + 4)) for b in range(0, 48, 4)]


def test_out_of_order_the_cursor_passes_batches_delivered_ahead(pinning):
    """in_order=False: once a late batch is handed out, the batches delivered ahead of
    it are behind the cursor (state_dict()'s next_seq), not listed one by one in
    delivered_ahead for the rest of the epoch, also while batches keep being ready
    (they were: 197 of 200 listed at the epoch's end)."""
    loader = fastloader.DataLoader(cds.IndexDataset(n=400, delays={8: 0.3}), batch_size=4,
                                   num_workers=2, pin_memory=True, in_order=False,
                                   multiprocessing_context="fork")
    listed, late_at = [], None
    for n, batch in enumerate(loader):
        if int(batch[0, 0]) == 8:
            late_at = n
        state = loader.state_dict()
        listed.append((len(state["delivered_ahead"]), state["next_seq"]))
        time.sleep(0.01)   # slower than the workers: batches are ready at each next()
    assert late_at is not None and late_at > 2, late_at   # batch 2 came out of order
    # the slow worker's next task may come late too (out of order, tasks go to the
    # worker with the fewest): a few batches on, nothing is that far behind
    after = listed[late_at + 4:]
    assert after and max(count for count, _ in after) <= 8, listed
    assert listed[-1] == (0, 100), listed[-1]


def test_out_of_order_a_due_batch_comes_next_after_a_timeout_in_its_pinning(
        pinning, monkeypatch):
    gate = _gated_pinning(pinning, monkeypatch, 4)   # batch 1: stuck on the pin thread
    loader = fastloader.DataLoader(cds.IndexDataset(n=24), batch_size=4, num_workers=2,
                                   pin_memory=True, in_order=False, timeout=0.5,
                                   multiprocessing_context="fork")
    it = iter(loader)
    time.sleep(0.5)   # batches 0-3 are published: 1-3 are taken ahead as 0 is handed out
    seen = [int(next(it)[0, 0])]
    with pytest.raises(RuntimeError, match="timed out after 0.5 seconds"):
        while True:
            seen.append(int(next(it)[0, 0]))
    gate.set()
    # torch's next() after the timeout gives the batch the thread was pinning
    assert seen == [0] and int(next(it)[0, 0]) == 4, seen
    assert sorted(seen + [4] + [int(b[0, 0]) for b in it]) == list(range(0, 24, 4))


@pytest.mark.parametrize("resumed", [False, True])
def test_out_of_order_the_cursor_passes_them_whichever_way_the_late_batch_comes(pinning,
                                                                               resumed):
    """The late batch waited for (not taken ahead), or the first after a resume whose
    state lists batches delivered ahead: the cursor must pass the batches delivered
    ahead then too (it stayed on the next one: 297 of 300 listed)."""
    delays = {i: 0.005 for i in range(200)}
    delays[2] = 0.3

    def make():
        return fastloader.DataLoader(cds.IndexDataset(n=200, delays=delays), batch_size=1,
                                     num_workers=2, pin_memory=True, in_order=False,
                                     multiprocessing_context="fork")

    loader = make()
    if resumed:   # saved while batch 2 is late, with batches delivered ahead of it
        it = iter(loader)
        head = [int(next(it)[0, 0]) for _ in range(12)]
        state = loader.state_dict()
        del it
        assert 2 not in head and state["delivered_ahead"], (head, state)
        loader = make()
        loader.load_state_dict(state)
    started, paused, listed = time.monotonic(), False, []
    for batch in loader:
        state = loader.state_dict()
        listed.append((int(batch[0, 0]), len(state["delivered_ahead"]), state["next_seq"]))
        if not paused and time.monotonic() - started > 0.15:
            paused = True
            time.sleep(0.4)    # the late batch and others are published meanwhile
        elif paused:
            time.sleep(0.01)   # slower than the workers from here on
    late_at = [value for value, _, _ in listed].index(2)   # (late again when resumed)
    assert max(count for _, count, _ in listed[late_at + 4:]) <= 8, listed
    assert listed[-1][1:] == (0, 200), listed[-1]


def test_out_of_order_batches_taken_ahead_and_handed_out_in_turn_leave_no_trace(pinning):
    """A loop slower than the workers gets nearly every batch in its turn, after it was
    taken ahead: _ready kept each one's number to the epoch's end (709 of 750)."""
    loader = fastloader.DataLoader(cds.IndexDataset(n=1200), batch_size=4, num_workers=2,
                                   pin_memory=True, in_order=False,
                                   multiprocessing_context="fork")
    it = iter(loader)
    held, seen = [], []
    for batch in it:
        seen.append(int(batch[0, 0]))
        held.append(len(it._ready))
        time.sleep(0.002)
    assert sorted(seen) == list(range(0, 1200, 4))
    assert max(held) <= 16, held
