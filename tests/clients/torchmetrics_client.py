"""torchmetrics in an eval loop: BinaryAUROC and BinaryAveragePrecision keep every
batch's scores and targets in list states until compute() (as metrics over the whole
epoch must). Those are the batch's own small tensors: with fastloader each must hold
its own bytes, not the ring slot of its batch (the images). Usage: LOADER OUT."""
import gc

import torch
from torch.utils.data import Dataset
from torchmetrics.classification import BinaryAUROC, BinaryAveragePrecision

from tests.clients.client_common import loader_facts, parse_argv, save
from tests.support.helpers import RING_SEGMENTS, TORCH_SEGMENTS, clone_batch, ring_bytes

BATCH, BATCHES, IMAGE = 32, 40, (3, 64, 64)   # 1.5 MiB of images per batch


class ScoredImages(Dataset):
    def __len__(self):
        return BATCH * BATCHES

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"image": torch.rand(IMAGE, generator=g),
                "score": torch.rand((), generator=g),
                "target": int(torch.randint(0, 2, (), generator=g))}


def main():
    DataLoader, out, _ = parse_argv()
    loader = DataLoader(ScoredImages(), batch_size=BATCH, num_workers=2,
                        multiprocessing_context="fork")
    auroc, ap = BinaryAUROC(), BinaryAveragePrecision()
    batches = []
    for batch in loader:
        # what a model would do with the images, then the metrics' update
        assert batch["image"].shape == (BATCH, *IMAGE)
        auroc.update(batch["score"], batch["target"])
        ap.update(batch["score"], batch["target"])
        batches.append(clone_batch({"score": batch["score"], "target": batch["target"]}))
        del batch
    gc.collect()
    # fastloader's ring and torch's per-storage segments, while the metrics still
    # hold every batch's tensors
    held = ring_bytes(RING_SEGMENTS + TORCH_SEGMENTS)
    kept = auroc.preds + auroc.target
    assert len(kept) == 2 * BATCHES, len(kept)
    save(out, batches=batches, loader=loader_facts(loader), held=held,
         kept_bytes=sum(t.untyped_storage().nbytes() for t in kept),
         auroc=auroc.compute(), ap=ap.compute())


if __name__ == "__main__":
    main()
