"""Per-batch fetch time of a packed array (issue 14): torch's fetcher without
__getitems__ (``[a[i] for i in indices]``) against ``a.__getitems__(indices)``, on the
same random batches of 64 indices, interleaved in one run; medians over repeats.

    PYTHONPATH=python:. python -m benchmarks.packed_getitems [--items N] [--repeats R]
"""
import argparse
import random
import statistics
import time

from fastloader.packed import PackedArray, PackedStringArray


def per_batch_us(fetch, batches, inner):
    """Median over batches of the mean time of one fetch (inner calls timed together)."""
    times = []
    for indices in batches:
        t0 = time.perf_counter()
        for _ in range(inner):
            fetch(indices)
        times.append((time.perf_counter() - t0) / inner * 1e6)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    rng = random.Random(0)
    names = [f"train/n{rng.randrange(10**8):08d}/img_{i:08d}.JPEG" for i in range(args.items)]
    arrays = {"PackedStringArray": PackedStringArray(names),
              "PackedArray(records)": PackedArray(
                  [{"id": i, "bbox": [1.0, 2.0, 3.0, 4.0], "cat": i % 80}
                   for i in range(args.items // 10)])}
    for label, a in arrays.items():
        batches = [[rng.randrange(len(a)) for _ in range(args.batch)] for _ in range(200)]
        comp, vec = [], []
        for _ in range(args.repeats):   # interleaved: drift on a shared box hits both
            comp.append(per_batch_us(lambda idx: [a[i] for i in idx], batches, 5))
            vec.append(per_batch_us(a.__getitems__, batches, 5))
        mc, mv = statistics.median(comp), statistics.median(vec)
        print(f"{label}: {args.batch} indices/batch, {len(a)} items: "
              f"list comprehension {mc:.2f} us/batch, __getitems__ {mv:.2f} us/batch, "
              f"ratio {mc / mv:.2f}x (medians of {args.repeats} repeats x 200 batches)")


if __name__ == "__main__":
    main()
