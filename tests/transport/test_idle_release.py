"""A persistent worker's ring holds no memory between epochs.

torch's persistent workers hold no shared memory between epochs (each batch's
segments go with the batch). A fastloader worker keeps its free slots' pages
reserved while batches come (so the next batch of that size writes into pages
already there); once its epoch is over (the iterator says so) and it has waited
5 s for a task (csrc/channel_worker.c, FL_IDLE_RELEASE_NS), it gives them back,
and a slot freed later while it still waits too; the next epoch reserves them
again as its batches need. Never within an epoch, however slow the loop."""
import gc
import time

import pytest
import torch
import torch.utils.data

import fastloader
from tests.support.helpers import deadline, ring_bytes

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

BATCH, BATCHES = 8, 12
SAMPLE = (256, 256)            # 256 KiB of float32 per sample: 2 MiB per batch
BATCH_BYTES = BATCH * SAMPLE[0] * SAMPLE[1] * 4


class Big(torch.utils.data.Dataset):
    def __len__(self):
        return BATCH * BATCHES

    def __getitem__(self, i):
        return torch.full(SAMPLE, float(i))


def published(it):
    return sum(w["published"] for w in it.stats()["workers"])


def reserved(it):
    return sum(w["arena_reserved_bytes"] for w in it.stats()["workers"])


def wait_for(what, check, seconds=60):
    """Poll `check()` until it holds; the release comes ~5.2 s into the idling."""
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, f"{what}: not within {seconds} s"
        time.sleep(0.05)


@pytest.mark.parametrize("strategy,epochs,pause_at", [
    ("file_descriptor", 2, 3), ("file_system", 1, None)])
def test_idle_persistent_workers_give_their_ring_back(strategy, epochs, pause_at):
    gc.collect()
    base = ring_bytes()   # what earlier tests in this process still map (held batches)
    loader = fastloader.DataLoader(Big(), batch_size=BATCH, num_workers=2,
                                   persistent_workers=True, multiprocessing_context="fork",
                                   sharing_strategy=strategy)
    with deadline(240):
        for epoch in range(epochs):
            it = iter(loader)
            held = None
            for i, batch in enumerate(it):
                assert float(batch[0, 0, 0]) == i * BATCH
                if pause_at == i and epoch == 0:
                    # a consumer slower than the wait is still within the epoch:
                    # nothing is given back (each batch would fault its pages in
                    # again, in both processes; found by review). The workers have
                    # built what they were asked for and wait; this batch's slot is
                    # free for the whole pause.
                    wait_for("the tasks sent built", lambda: published(it) == i + 1 + 2 * 2)
                    del batch
                    before = reserved(it)
                    time.sleep(6)
                    assert reserved(it) == before >= BATCH_BYTES, (before, reserved(it))
                    continue
                if i == BATCHES - 1:
                    held = batch          # the loop keeps the epoch's last batch a while
            # during the epoch the ring held the batches in flight and their slots
            assert reserved(it) >= 2 * BATCH_BYTES, it.stats()["workers"]
            assert ring_bytes() - base >= 2 * BATCH_BYTES
            # idle: every free slot is given back; the held batch's slot stays (its
            # batch and the encoding's header, in whole pages)
            wait_for("free slots released", lambda: reserved(it) <= BATCH_BYTES + (64 << 10))
            assert float(held[0, 0, 0]) == (BATCHES - 1) * BATCH   # intact
            del held, batch
            # freed while its worker waits: given back too
            wait_for("the held batch's slot released", lambda: reserved(it) == 0)
            wait_for("the pages gone from the segments",
                     lambda: ring_bytes() - base < BATCH_BYTES)
        # a second epoch reserves them again as it needs them, and gives them back
