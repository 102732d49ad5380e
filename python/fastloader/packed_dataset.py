"""PackedImageFolder: torchvision's ImageFolder (file paths + integer labels from a
``root/<class>/**/<file>`` tree) with an index that no worker copies.

torchvision's ImageFolder keeps ``samples`` as a list of (path, label) tuples: three
Python objects per image, copied by every worker (see fastloader.packed). Here the
paths are one PackedStringArray (relative to ``root``) and the labels are implicit:
the files of each class are contiguous, so a label is a binary search over the
class boundaries (one int per class).

The files, their order, the classes and the errors are those of torchvision 0.29's
ImageFolder (DatasetFolder.make_dataset), so the same seed gives the same batches:

* classes: the sorted names of the entries of ``root`` that are directories
  (``os.scandir``, links followed); none is a FileNotFoundError;
* per class, in sorted class order: ``os.walk(root/class, followlinks=True)``, its
  directories visited in the sorted order of their full paths (so a folder's own
  files come before any sub-folder's, and "a.b" sorts before "a/x"), the file
  names of each directory sorted; a file is kept when
  ``is_valid_file(full_path)``, by default ``full_path.lower().endswith(extensions)``;
* ``extensions`` and ``is_valid_file`` are mutually exclusive, one is required; a
  class without a valid file is a FileNotFoundError unless ``allow_empty``.

Walking the tree runs in Python, as torchvision's does: building the index costs
what building an ImageFolder costs; reading it afterwards costs no copies.
"""
from __future__ import annotations

import bisect
import os
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

from torch.utils.data import Dataset

from .packed import PackedStringArray, _build

__all__ = ["PackedImageFolder", "IMG_EXTENSIONS", "find_classes", "pil_loader",
           "has_file_allowed_extension"]

IMG_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")

_DEFAULT = object()   # extensions not given: IMG_EXTENSIONS unless is_valid_file is


def has_file_allowed_extension(filename: str, extensions: Union[str, Sequence[str]]) -> bool:
    """True when `filename`, lowercased (str.lower), ends with one of `extensions`
    (compared as given: pass them in lowercase), as torchvision matches them."""
    return filename.lower().endswith(extensions if isinstance(extensions, str)
                                     else tuple(extensions))


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


def _class_files(class_dir: str, is_valid: Callable[[str], bool], follow: bool):
    """(path relative to class_dir's parent, full path) of the valid files under
    class_dir, in torchvision's order (see the module docstring)."""
    # Each walk entry's directory path is unique, so ordering the entries by it is
    # ordering them as whole (dirpath, dirnames, filenames) tuples.
    walk = sorted(os.walk(class_dir, followlinks=follow), key=lambda entry: entry[0])
    for dirpath, _, fnames in walk:
        for fname in sorted(fnames):
            path = os.path.join(dirpath, fname)
            if is_valid(path):
                yield path


class _TrackedList(list):
    """A list (==, +, count, index, json, isinstance list: all list's) that remembers
    being changed in place, so that a changed ``samples`` list is what __getitem__
    reads and what workers receive, as with torchvision's own list."""

    __slots__ = ("changed",)

    def __init__(self, *args):
        super().__init__(*args)
        self.changed = False

    def __reduce__(self):   # pickles (and copies) as a plain list
        return list, (list(self),)


def _tracking(name):
    method = getattr(list, name)

    def changing(self, *args):
        self.changed = True
        return method(self, *args)
    changing.__name__ = name
    return changing


for _name in ("__setitem__", "__delitem__", "__iadd__", "__imul__", "append", "extend",
              "insert", "pop", "remove", "clear", "sort", "reverse"):
    setattr(_TrackedList, _name, _tracking(_name))
del _name

# dataset id -> {"samples": list, "targets": list} built in this process on first
# access. Kept outside the dataset, so that neither pickling (spawn workers) nor
# the heavy-metadata check sees lists that __getitem__ never reads.
_LISTS: dict = {}


def _forget_lists(key):
    _LISTS.pop(key, None)


class PackedImageFolder(Dataset):
    """``root/<class>/**/<file>`` as ``(loader(path), class_index)`` samples, exactly
    as torchvision's ``ImageFolder`` finds and orders them (see the module docstring).

    Args, in ImageFolder's order: ``root``; ``transform`` and ``target_transform``
    applied to the sample and the label; ``loader(path)`` reads a file (default:
    Pillow, RGB); ``is_valid_file(path)`` keeps a file (then ``extensions`` must not
    be given); ``allow_empty``: accept classes without a valid file. Keyword-only:
    ``extensions`` (DatasetFolder's: lowercase endings of the lowercased path;
    default IMG_EXTENSIONS unless ``is_valid_file`` is given), ``follow_symlinks``
    (enter linked directories, default True as torchvision; like os.walk it does not
    detect a link back to an ancestor) and ``sharing_strategy`` of the path array.

    Attributes: ``classes``, ``class_to_idx``, ``extensions``, ``samples`` and
    ``imgs`` (lists of (path, class index) tuples), ``targets`` (a list of ints), as
    torchvision's: settable, changeable in place. They are built from the packed
    index on first access in each process and never pickled into workers; as with
    torchvision, __getitem__ reads ``samples`` (a list set or changed in place is
    used, and then sent to workers), never ``targets``. Also ``paths`` (a
    PackedStringArray of paths relative to ``root``), ``path(i)``, ``target(i)``.
    Override ``find_classes(directory)`` to choose the classes, as with torchvision.
    """

    def __init__(self, root, transform: Optional[Callable] = None,
                 target_transform: Optional[Callable] = None,
                 loader: Optional[Callable[[str], object]] = None,
                 is_valid_file: Optional[Callable[[str], bool]] = None,
                 allow_empty: bool = False, *,
                 extensions: Union[str, Sequence[str], None] = _DEFAULT,
                 follow_symlinks: bool = True,
                 sharing_strategy: str = "file_descriptor"):
        if extensions is _DEFAULT:
            extensions = IMG_EXTENSIONS if is_valid_file is None else None
        if (extensions is None) == (is_valid_file is None):
            raise ValueError("Both extensions and is_valid_file cannot be None or not None "
                             "at the same time")
        self.root = os.path.expanduser(root) if isinstance(root, str) else root
        self.transform = transform
        self.target_transform = target_transform
        self.loader = loader
        self.extensions = extensions
        self.classes, self.class_to_idx = self.find_classes(self.root)
        if not self.class_to_idx:
            raise ValueError("'class_to_index' must have at least one entry to collect any "
                             "samples.")
        self._dir = os.fspath(os.path.expanduser(self.root))
        if is_valid_file is None:
            def is_valid_file(path, _ext=extensions):
                return has_file_allowed_extension(path, _ext)
        # classes in sorted order of their names (torchvision walks sorted(class_to_idx));
        # a class's files are contiguous, found by position, whatever index it has
        order = sorted(self.class_to_idx)
        indices = [self.class_to_idx[name] for name in order]
        starts = [0]

        def fill(writer):
            for name in order:
                class_dir = os.path.join(self._dir, name)
                before = writer.count
                if os.path.isdir(class_dir):
                    # stored relative to root: join(root, stored) is torchvision's path
                    cut = len(class_dir)
                    writer.extend(name + path[cut:] for path in
                                  _class_files(class_dir, is_valid_file, follow_symlinks))
                starts.append(starts[-1] + writer.count - before)

        self.paths: PackedStringArray = _build(PackedStringArray, fill, sharing_strategy)
        # starts[c] is the index of class c's first file; a tuple of len(classes) + 1 ints
        self._starts = tuple(starts)
        self._class_of = tuple(indices)
        # lists the user assigned: "samples", "imgs", "targets" -> list
        self._assigned: dict = {}
        empty = [name for c, name in enumerate(order) if starts[c] == starts[c + 1]]
        if empty and not allow_empty:
            msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
            if extensions is not None:
                listed = extensions if isinstance(extensions, str) else ", ".join(extensions)
                msg += f"Supported extensions are: {listed}"
            raise FileNotFoundError(msg)

    def find_classes(self, directory) -> Tuple[List[str], Dict[str, int]]:
        """The class folders of `directory` and their indices (override to choose)."""
        return find_classes(directory)

    def __len__(self) -> int:
        # torchvision's is len(self.samples): a samples list set or changed in place
        # (filtered, appended to) is the dataset
        samples = self._changed_samples()
        return len(self.paths) if samples is None else len(samples)

    def __copy__(self):
        """As copy.copy of torchvision's dataset: the copy's attributes are the same
        objects (the samples and targets lists too, built or set), and an attribute
        set on the copy afterwards is the copy's alone (`val = copy.copy(ds);
        val.samples = ds.samples[:n]` leaves ds as it was)."""
        new = type(self).__new__(type(self))
        new.__dict__.update(self.__dict__)
        new._assigned = dict(self._assigned)
        built = _LISTS.get(id(self))
        if built is None:   # lists built later, by either, are the other's too
            built = _LISTS[id(self)] = {}
            weakref.finalize(self, _forget_lists, id(self))
        _LISTS[id(new)] = built
        weakref.finalize(new, _forget_lists, id(new))
        return new

    def _index(self, index: int) -> int:
        n = len(self.paths)
        i = index + n if index < 0 else index
        if not 0 <= i < n:
            raise IndexError(f"PackedImageFolder index {index} out of range ({n} files)")
        return i

    def _target_at(self, i: int) -> int:
        return self._class_of[bisect.bisect_right(self._starts, i) - 1]

    def _changed_samples(self):
        """The samples list __getitem__ must read (one the user set or changed in
        place, as torchvision reads its own), else None: the packed index."""
        samples = self._assigned.get("samples")
        if samples is not None:
            return samples
        built = _LISTS.get(id(self))
        if built is not None and built.get("samples") is not None \
                and built["samples"].changed:
            return built["samples"]
        return None

    def target(self, index: int) -> int:
        """The class index of sample `index` (as __getitem__ labels it)."""
        samples = self._changed_samples()
        if samples is not None:
            return samples[index][1]
        return self._target_at(self._index(index))

    def path(self, index: int) -> str:
        """The full path of sample `index` (as torchvision's samples hold it)."""
        samples = self._changed_samples()
        if samples is not None:
            return samples[index][0]
        return os.path.join(self._dir, self.paths[index])

    def __getitem__(self, index: int):
        samples = self._changed_samples()
        if samples is not None:
            path, target = samples[index]
        else:
            i = self._index(index)
            target = self._target_at(i)
            path = os.path.join(self._dir, self.paths[i])
        sample = (self.loader or pil_loader)(path)
        if self.transform is not None:
            sample = self.transform(sample)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return sample, target

    def _built(self, name):
        """The list `name` made from the packed index, once per process."""
        lists = _LISTS.get(id(self))
        if lists is None:
            lists = _LISTS[id(self)] = {}
            weakref.finalize(self, _forget_lists, id(self))
        if name not in lists:
            if name == "samples":
                lists[name] = _TrackedList(
                    (os.path.join(self._dir, p), self._target_at(i))
                    for i, p in enumerate(self.paths))
            else:
                counts = [self._starts[c + 1] - self._starts[c]
                          for c in range(len(self._class_of))]
                lists[name] = _TrackedList(
                    t for t, n in zip(self._class_of, counts) for _ in range(n))
        return lists[name]

    @property
    def samples(self) -> list:
        """(full path, class index) of every sample, as torchvision's list."""
        if "samples" in self._assigned:
            return self._assigned["samples"]
        return self._built("samples")

    @samples.setter
    def samples(self, value):
        self._assigned["samples"] = value

    @property
    def imgs(self) -> list:
        """torchvision's alias: the samples list as built (setting samples later does
        not change it, as with torchvision)."""
        if "imgs" in self._assigned:
            return self._assigned["imgs"]
        return self._built("samples")

    @imgs.setter
    def imgs(self, value):
        self._assigned["imgs"] = value

    @property
    def targets(self) -> list:
        """Every sample's class index, as torchvision's list of ints."""
        if "targets" in self._assigned:
            return self._assigned["targets"]
        return self._built("targets")

    @targets.setter
    def targets(self, value):
        self._assigned["targets"] = value

    def __getstate__(self):
        state = self.__dict__.copy()
        # lists built from the index stay behind (workers rebuild them if they read
        # them at all); lists changed in place travel, as the user's own would
        built = _LISTS.get(id(self), {})
        changed = {k: v for k, v in built.items() if v.changed}
        if "samples" in changed and "imgs" not in self._assigned:
            changed["imgs"] = changed["samples"]   # still one list, as built
        if changed:
            state["_assigned"] = {**changed, **self._assigned}
        return state

    def __repr__(self) -> str:
        return (f"PackedImageFolder(root={self.root!r}, {len(self)} files, "
                f"{len(self.classes)} classes)")
