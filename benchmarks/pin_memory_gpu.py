"""pin_memory=True on a CUDA machine: torch's DataLoader against fastloader.

    python -m benchmarks.pin_memory_gpu                  # 4 workers, 5 repeats
    python -m benchmarks.pin_memory_gpu --workers 8 --repeats 9
    python -m benchmarks.pin_memory_gpu --out-of-order   # in_order=False

Needs a CUDA GPU (it says so and exits 2 without one); `make bench` does not run it.
Each epoch moves batches of 64 images (uint8 or float32, 3x224x224: 9.6 or 38.5 MB)
to the GPU with ``.to("cuda", non_blocking=True)``, runs a fixed GPU step on them
(20 matrix products, or none) and syncs once per batch, as a loop that reads its
loss does. Every batch is checked to be pinned and in order (with --out-of-order,
the loaders get in_order=False, and each epoch is checked to have every batch once).

Three loaders, each built once with persistent fork workers and alternated epoch by
epoch (the first epoch is not timed): torch's; fastloader; and fastloader with every
batch pinned at its turn on the main thread, as it was before batches were pinned
ahead (pin_ahead.py). Figures are medians of the epoch times.
"""
import argparse
import statistics
import sys
import time

import torch
import torch.utils.data

import fastloader
import fastloader.iterator as fastloader_iterator

BATCH = 64


class Images(torch.utils.data.Dataset):
    """A few ready images returned as they are: the collate's copy and the pinning
    are what the loop pays for."""

    def __init__(self, length, dtype):
        generator = torch.Generator().manual_seed(0)
        self.length = length
        self.images = [torch.randint(0, 256, (3, 224, 224), generator=generator).to(dtype)
                       for _ in range(4)]

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        return self.images[index % 4], index


def _gpu_step(batch, weight, products):
    flat = batch.reshape(batch.shape[0], -1)[:, :weight.shape[0]].float()
    out = flat.sum()
    for _ in range(products):
        out = (flat @ weight).sum()
    return out.item()


def _epoch(loader, weight, products, in_order):
    start = time.perf_counter()
    firsts = []
    for n, (images, indices) in enumerate(loader):
        if not (images.is_pinned() and indices.is_pinned()):
            raise AssertionError(f"batch {n} was not pinned")
        firsts.append(int(indices[0]))
        if in_order and firsts[-1] != n * BATCH:
            raise AssertionError(f"batch {n} out of order: {indices[:4].tolist()}")
        _gpu_step(images.to("cuda", non_blocking=True), weight, products)
    seconds = time.perf_counter() - start
    if sorted(firsts) != list(range(0, len(loader.dataset), BATCH)):
        raise AssertionError("an epoch did not have every batch once")
    return seconds


class _AtItsTurn(fastloader_iterator.PinAhead):
    """Gives nothing to the thread: the iterator pins each batch on the main thread
    when it hands it out (with no batch taken ahead either, as before pin_ahead.py)."""

    def give(self, seq, data):
        return data


def _no_take_ahead(iterator):
    return None


LOADERS = ("torch", "fastloader", "fastloader, pinned at its turn")


def measure(dtype, batches, products, workers, repeats, in_order=True):
    dataset = Images(batches * BATCH, dtype)
    weight = torch.randn(4096, 4096, device="cuda")
    kw = dict(batch_size=BATCH, num_workers=workers, pin_memory=True, in_order=in_order,
              persistent_workers=True, multiprocessing_context="fork")
    loaders = {"torch": torch.utils.data.DataLoader(dataset, **kw),
               "fastloader": fastloader.DataLoader(dataset, **kw),
               "fastloader, pinned at its turn": fastloader.DataLoader(dataset, **kw)}
    pin_ahead = fastloader_iterator.PinAhead
    iterator_class = fastloader_iterator.FastMultiProcessingIter
    take_ahead = iterator_class._take_ahead
    times = {name: [] for name in loaders}
    try:
        for repeat in range(repeats + 1):
            for name, loader in loaders.items():
                # the class the iterator makes at each epoch's start
                at_its_turn = name.endswith("turn")
                fastloader_iterator.PinAhead = _AtItsTurn if at_its_turn else pin_ahead
                iterator_class._take_ahead = _no_take_ahead if at_its_turn else take_ahead
                seconds = _epoch(loader, weight, products, in_order)
                if repeat:
                    times[name].append(seconds)
    finally:
        fastloader_iterator.PinAhead = pin_ahead
        iterator_class._take_ahead = take_ahead
    return {name: statistics.median(t) for name, t in times.items()}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=100)
    parser.add_argument("--out-of-order", action="store_true",
                        help="the loaders get in_order=False")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("pin_memory_gpu: needs a CUDA GPU; none is available", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.workers} workers, batch {BATCH}, {args.batches} batches per epoch, "
          f"median of {args.repeats} epochs (ms)"
          + (", in_order=False" if args.out_of_order else ""))
    print("| images | GPU step | " + " | ".join(LOADERS)
          + " | torch / fastloader | at its turn / fastloader |")
    print("|---|---:|" + "---:|" * (len(LOADERS) + 2))
    for dtype, label in ((torch.uint8, "uint8, 9.6 MB"), (torch.float32, "float32, 38.5 MB")):
        for products in (0, 20):
            med = measure(dtype, args.batches, products, args.workers, args.repeats,
                          in_order=not args.out_of_order)
            fl = med["fastloader"]
            print(f"| {label} | {products} products | "
                  + " | ".join(f"{med[name] * 1000:.0f}" for name in LOADERS)
                  + f" | **{med['torch'] / fl:.2f}x** | {med[LOADERS[2]] / fl:.2f}x |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
