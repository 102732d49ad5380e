"""torchvision: ImageFolder + RandomResizedCrop (seeded) under torch's DataLoader vs
fastloader.PackedImageFolder under fastloader's, on a generated tree of JPEG and PNG
files with nested sub-folders in the class folders: same classes, class_to_idx,
samples, targets and the same batches.

PyPI's torchvision does not import beside the torch 2.13.0 CPU wheel of the main venv,
so this runs in `make test-compat` (.venv-compat: torch 2.14.1 + torchvision 0.29.1)."""
import os

import pytest
import torch

from tests.clients.conftest import assert_fastloader_ran, assert_same_runs, run_client

try:
    import torchvision  # noqa: F401
except Exception as exc:   # ImportError, or a torchvision built for another torch
    pytest.skip(f"torchvision is not importable beside torch {torch.__version__} ({exc!r}); "
                "`make test-compat` runs this test on torch 2.14.1 + torchvision 0.29.1",
                allow_module_level=True)

from PIL import Image  # noqa: E402  (torchvision requires Pillow)

# Relative paths whose order differs between a sorted walk (torchvision) and a sort of
# whole relative paths: "a-b" < "a/b" bytewise ('-' < '/'), but os.walk visits "a"'s
# files, then "a-b", then "a/b"; upper-case classes and extensions; a file to skip.
TREE = [
    "cat/x.jpg", "cat/a/y.jpg", "cat/a-b/z.png", "cat/a/b/w.png", "cat/B.JPG",
    "cat/notes.txt",
    "dog/1.png", "dog/10.png", "dog/2.jpeg", "dog/sub/3.png", "dog/sub_2/4.jpg",
    "dog/sub.d/5.png", "dog/sub/deeper/6.jpg",
    "Zebra/z1.png", "Zebra/deep/er/z2.jpg", "Zebra/deep-er/z3.png",
]


def make_tree(root):
    for i, rel in enumerate(TREE):
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if rel.endswith(".txt"):
            with open(path, "w") as f:
                f.write("not an image\n")
            continue
        # sizes, modes and contents differ per file, so crops of different files differ
        size = (20 + 3 * i, 18 + 5 * (i % 4))
        mode = "L" if i % 5 == 0 else "RGB"
        gen = torch.Generator().manual_seed(i)
        pixels = torch.randint(0, 256, (size[1], size[0], 3 if mode == "RGB" else 1),
                               dtype=torch.uint8, generator=gen)
        img = Image.fromarray(pixels.squeeze(-1).numpy(), mode)
        img.save(path, format="JPEG" if rel.lower().endswith((".jpg", ".jpeg")) else "PNG")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_packed_image_folder_matches_image_folder(out_dir, method):
    root = os.path.join(out_dir, "images")
    make_tree(root)
    ref = run_client("torchvision_client.py", "torch", out_dir, root, method)
    got = run_client("torchvision_client.py", "fastloader", out_dir, root, method)
    want, have = ref["index"], got["index"]
    assert have["classes"] == want["classes"] == ["Zebra", "cat", "dog"]
    assert have["class_to_idx"] == want["class_to_idx"]
    assert len(want["order"]) == len(TREE) - 1   # notes.txt is not an image
    assert have["order"] == want["order"], "file order differs from ImageFolder's"
    assert have["samples"] == want["samples"]
    assert have["targets"] == want["targets"]
    assert_same_runs(ref, got, f"ImageFolder vs PackedImageFolder ({method})")
    assert len(ref["batches"]) == 8 and ref["batches"][0][0].dtype == torch.uint8
    assert_fastloader_ran(got["loader"], workers=2)
