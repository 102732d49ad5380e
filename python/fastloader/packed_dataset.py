"""PackedImageFolder: an ImageFolder-style dataset (file paths + integer labels from
a ``root/<class>/**/<file>`` tree) whose index no worker copies.

torchvision's ImageFolder keeps ``samples`` as a list of (path, label) tuples: three
Python objects per image, copied by every worker (see fastloader.packed). Here the
paths are one PackedStringArray (relative to ``root``) and the labels are implicit:
the files of each class are contiguous, so a label is a binary search over the
class boundaries (one int per class).
"""
from __future__ import annotations

import bisect
import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch.utils.data import Dataset

from . import _core
from .packed import PackedStringArray, _build, _suffix_tuple

__all__ = ["PackedImageFolder", "IMG_EXTENSIONS", "find_classes", "pil_loader"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def find_classes(directory) -> Tuple[List[str], Dict[str, int]]:
    """The class folders of `directory`, sorted, and their indices (as torchvision)."""
    classes = sorted(entry.name for entry in os.scandir(directory) if entry.is_dir())
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {directory}.")
    return classes, {name: i for i, name in enumerate(classes)}


def pil_loader(path: str):
    """Open an image file as an RGB PIL image (torchvision's default loader)."""
    try:
        from PIL import Image
    except ImportError as exc:   # pragma: no cover - depends on the environment
        raise ImportError("PackedImageFolder's default loader needs Pillow "
                          "(pip install pillow), or pass loader=...") from exc
    with open(path, "rb") as f:
        img = Image.open(f)
        return img.convert("RGB")


class PackedImageFolder(Dataset):
    """``root/<class>/**/<file>`` as ``(loader(path), class_index)`` samples.

    Args (as torchvision's ImageFolder/DatasetFolder): ``root``; ``transform`` and
    ``target_transform`` applied to the sample and the label; ``loader(path)`` reads
    a file (default: Pillow, RGB); ``extensions``: file name endings, matched
    ignoring ASCII case (None: every file); ``allow_empty``: accept class folders
    with no matching file. Plus ``follow_symlinks`` (enter linked directories,
    default True as torchvision) and ``sharing_strategy`` of the path array.

    Classes are the sorted sub-folders of ``root``; within a class, files are
    sorted by their path relative to the class folder (bytewise), found through any
    depth of sub-folders. Attributes: ``classes``, ``class_to_idx``, ``paths`` (a
    PackedStringArray of paths relative to ``root``), ``targets`` (a NumPy int64
    array, built when asked for), ``path(i)``, ``target(i)``.
    """

    def __init__(self, root, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None,
                 loader: Optional[Callable[[str], object]] = None,
                 extensions: Union[str, Sequence[str], None] = IMG_EXTENSIONS, *,
                 allow_empty: bool = False, follow_symlinks: bool = True,
                 sharing_strategy: str = "file_descriptor"):
        self.root = os.fspath(root)
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader
        self.extensions = extensions
        self.classes, self.class_to_idx = find_classes(self.root)
        root_b = os.fsencode(self.root)
        suffixes = _suffix_tuple(extensions)
        starts = [0]

        def fill(writer):
            for name in self.classes:
                prefix = os.fsencode(name) + b"/"
                n = _core.packed_scan(writer, os.path.join(root_b, os.fsencode(name)), prefix,
                                      suffixes, follow_symlinks)
                starts.append(starts[-1] + n)

        self.paths: PackedStringArray = _build(PackedStringArray, fill, sharing_strategy)
        # starts[c] is the index of class c's first file; a tuple of len(classes) + 1 ints
        self._starts = tuple(starts)
        empty = [c for i, c in enumerate(self.classes) if starts[i] == starts[i + 1]]
        if empty and not allow_empty:
            wanted = ", ".join(extensions) if isinstance(extensions, (list, tuple)) \
                else str(extensions)
            raise FileNotFoundError(f"Found no valid file for the classes {', '.join(empty)}. "
                                    f"Supported extensions are: {wanted}")

    def __len__(self) -> int:
        return len(self.paths)

    def _index(self, index: int) -> int:
        n = len(self.paths)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"PackedImageFolder index {index} out of range ({n} files)")
        return i

    def target(self, index: int) -> int:
        """The class index of sample `index`."""
        return bisect.bisect_right(self._starts, self._index(index)) - 1

    def path(self, index: int) -> str:
        """The full path of sample `index`."""
        return os.path.join(self.root, self.paths[index])

    def __getitem__(self, index: int):
        i = self._index(index)
        target = bisect.bisect_right(self._starts, i) - 1
        sample = (self.loader or pil_loader)(os.path.join(self.root, self.paths[i]))
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    @property
    def targets(self):
        """Every sample's class index, as a NumPy int64 array (made on each access)."""
        import numpy as np

        counts = np.diff(np.asarray(self._starts, dtype=np.int64))
        return np.repeat(np.arange(len(self.classes), dtype=np.int64), counts)

    def __repr__(self) -> str:
        return (f"PackedImageFolder(root={self.root!r}, {len(self)} files, "
                f"{len(self.classes)} classes)")
