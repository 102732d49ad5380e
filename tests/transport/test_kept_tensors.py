"""A small tensor kept from each batch does not keep its batch.

An eval loop that keeps `batch["label"]` of every batch (to score the epoch at its
end) holds only the labels with torch's DataLoader. Batches are views of ring slots
here, so the decoder copies a big batch's small tensors and arrays out of the slot
(csrc/codec.c, FL_COPY_OUT_*): keeping them keeps no slot, and the ring does not grow
by a batch for every label kept."""
import gc
import pickle

import numpy as np
import pytest
import torch
import torch.utils.data

import fastloader
from tests.support.helpers import deadline, ring_bytes, span_in_segments, tensor_span

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

BATCH, BATCHES = 32, 40
IMAGE = (3, 64, 64)            # 48 KiB of float32 per sample: 1.5 MiB per batch


class Images(torch.utils.data.Dataset):
    """An image and a label; with `feature`, a float32 vector of that many values
    between them (ahead of the label in the batch the decoder reads)."""

    def __init__(self, image=IMAGE, n=BATCH * BATCHES, feature=0):
        self.image, self.n, self.feature = image, n, feature

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        sample = {"img": torch.full(self.image, float(i % 7))}
        if self.feature:
            sample["feat"] = torch.full((self.feature,), float(i))
        sample["label"] = i
        return sample


def numpy_collate(samples):
    return {"img": np.stack([s["img"].numpy() for s in samples]),
            "label": np.array([s["label"] for s in samples], dtype=np.int64),
            "none": np.zeros((len(samples), 0, 3)), "none_f": np.zeros((2, 0, 3), order="F")}


def label_and_view_collate(samples):
    batch = torch.utils.data.default_collate(samples)
    batch["every_other"] = batch["label"][::2]   # shares the labels' storage
    return batch


@pytest.mark.parametrize("strategy,feature", [
    ("file_descriptor", 0), ("file_system", 0), ("file_descriptor", 819)])
def test_keeping_each_batchs_labels_keeps_no_batch(strategy, feature):
    loader = fastloader.DataLoader(Images(feature=feature), batch_size=BATCH, num_workers=2,
                                   multiprocessing_context="fork", sharing_strategy=strategy)
    batch_bytes = BATCH * int(np.prod(IMAGE)) * 4
    gc.collect()
    base = ring_bytes()   # what earlier tests in this process still map (held batches)
    kept, views = [], []
    with deadline(120):
        it = iter(loader)
        for batch in it:
            kept.append(batch["label"])
            if span_in_segments(tensor_span(kept[-1]), it.segments()):
                views.append(len(kept) - 1)
            del batch
        mapped = ring_bytes() - base
        stats = it.stats()
    # torch keeps 40 label tensors; before the copy-out, every kept label kept its
    # 1.5 MiB batch (overflow segments for 30 of them: 60 MiB held here)
    assert mapped < 16 * batch_bytes, (
        f"{mapped / 2**20:.1f} MiB of ring segments held after keeping {BATCHES} label tensors")
    assert sum(w["arena_reserved_bytes"] for w in stats["workers"]) < 16 * batch_bytes, stats
    assert views == [], f"these batches' labels are views of a ring slot: {views}"
    del it, loader
    gc.collect()
    expected = [b["label"] for b in torch.utils.data.DataLoader(Images(feature=feature),
                                                                 batch_size=BATCH)]
    assert len(kept) == len(expected) == BATCHES
    for i, (got, want) in enumerate(zip(kept, expected)):
        assert got.dtype == want.dtype and torch.equal(got, want), i


def test_a_kept_image_still_keeps_its_batch_as_torch_keeps_its_storage():
    """The big tensors stay views of the slot (no copy on arrival)."""
    loader = fastloader.DataLoader(Images(n=BATCH * 4), batch_size=BATCH, num_workers=2,
                                   multiprocessing_context="fork")
    with deadline(120):
        it = iter(loader)
        for batch in it:
            assert span_in_segments(tensor_span(batch["img"]), it.segments())
            first = int(batch["label"][0])
            want = ((torch.arange(len(batch["label"])) + first) % 7).to(torch.float32)
            assert torch.equal(batch["img"][:, 0, 0, 0], want)


def test_small_numpy_arrays_of_a_big_batch_own_their_memory():
    loader = fastloader.DataLoader(Images(n=BATCH * 4), batch_size=BATCH, num_workers=2,
                                   multiprocessing_context="fork", collate_fn=numpy_collate)
    reference = torch.utils.data.DataLoader(Images(n=BATCH * 4), batch_size=BATCH,
                                            collate_fn=numpy_collate)
    with deadline(120):
        for batch, want in zip(loader, reference):
            labels = batch["label"]
            assert labels.base is None and labels.flags.owndata and labels.flags.writeable
            labels.resize((BATCH + 1,), refcheck=False)   # as torch's batch allows
            assert labels[:BATCH].tolist() == want["label"].tolist()
            assert batch["img"].base is not None   # the image is still a view of its slot
            np.testing.assert_array_equal(batch["img"], want["img"])
            # arrays of no bytes stay views, strides and order as torch's workers give
            # them (pickled: NumPy's own allocation of no bytes has strides of 0)
            for key in ("none", "none_f"):
                got, ref = batch[key], pickle.loads(pickle.dumps(want[key]))
                assert (got.shape, got.strides, got.flags.f_contiguous) == \
                    (ref.shape, ref.strides, ref.flags.f_contiguous), key


def test_copied_out_tensors_keep_their_aliasing():
    loader = fastloader.DataLoader(Images(n=BATCH * 4), batch_size=BATCH, num_workers=2,
                                   multiprocessing_context="fork",
                                   collate_fn=label_and_view_collate)
    with deadline(120):
        it = iter(loader)
        for batch in it:
            label, view = batch["label"], batch["every_other"]
            assert not span_in_segments(tensor_span(label), it.segments())
            assert view.untyped_storage().data_ptr() == label.untyped_storage().data_ptr()
            assert view.stride() == (2,) and torch.equal(view, label[::2])
            label[0] = -1
            assert view[0].item() == -1


def test_a_small_batch_copies_nothing():
    """Under 16 KiB of data a batch's slot is a few pages, about what torch holds per
    kept tensor: its labels stay views, and the batch arrives with no copy."""
    loader = fastloader.DataLoader(Images(image=(16,), n=BATCH * 4), batch_size=BATCH,
                                   num_workers=2, multiprocessing_context="fork")
    with deadline(120):
        it = iter(loader)
        for batch in it:
            for t in (batch["img"], batch["label"]):
                assert span_in_segments(tensor_span(t), it.segments())
