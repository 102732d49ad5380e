"""A persistent worker's ring holds no memory between epochs.

torch's persistent workers hold no shared memory between epochs (each batch's
segments go with the batch). A fastloader worker keeps its free slots' pages
reserved while batches come (so the next batch of that size writes into pages
already there); once it has waited 5 s for a task (csrc/channel_worker.c,
FL_IDLE_RELEASE_NS) it gives them back, and a slot freed later while it still
waits too, and the next epoch reserves them again as its batches need."""
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


def reserved(it):
    return sum(w["arena_reserved_bytes"] for w in it.stats()["workers"])


def wait_for(what, check, seconds=60):
    """Poll `check()` until it holds; the release comes ~5.2 s into the idling."""
    end = time.monotonic() + seconds
    while not check():
        assert time.monotonic() < end, f"{what}: not within {seconds} s"
        time.sleep(0.05)


@pytest.mark.parametrize("strategy,epochs", [("file_descriptor", 2), ("file_system", 1)])
def test_idle_persistent_workers_give_their_ring_back(strategy, epochs):
    loader = fastloader.DataLoader(Big(), batch_size=BATCH, num_workers=2,
                                   persistent_workers=True, multiprocessing_context="fork",
                                   sharing_strategy=strategy)
    with deadline(240):
        for epoch in range(epochs):
            it = iter(loader)
            held = None
            for i, batch in enumerate(it):
                assert float(batch[0, 0, 0]) == i * BATCH
                if i == BATCHES - 1:
                    held = batch          # the loop keeps the epoch's last batch a while
            # during the epoch the ring held the batches in flight and their slots
            assert reserved(it) >= 2 * BATCH_BYTES, it.stats()["workers"]
            assert ring_bytes() >= 2 * BATCH_BYTES
            # idle: every free slot is given back; the held batch's slot stays (its
            # batch and the encoding's header, in whole pages)
            wait_for("free slots released", lambda: reserved(it) <= BATCH_BYTES + (64 << 10))
            assert float(held[0, 0, 0]) == (BATCHES - 1) * BATCH   # intact
            del held, batch
            # freed while its worker waits: given back too
            wait_for("the held batch's slot released", lambda: reserved(it) == 0)
            wait_for("the pages gone from the segments", lambda: ring_bytes() < BATCH_BYTES)
        # a second epoch reserves them again as it needs them, and gives them back
