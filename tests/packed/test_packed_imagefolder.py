"""PackedImageFolder finds, orders and labels files exactly as torchvision's
ImageFolder (issue 13, item 6).

torchvision does not import beside this venv's torch, so the reference below is an
independent implementation of the behaviour of torchvision 0.29's
``find_classes`` + ``make_dataset`` (another venv compares against the real one):

* classes: sorted names of the entries of root that are directories (links
  followed); none: FileNotFoundError("Couldn't find any class folder in {root}.");
* for each class in sorted order, every directory reached from root/class (links
  to directories followed), visited in the sorted order of its full path; in each,
  its non-directory entries (dangling links too) in sorted name order; a file is
  kept when is_valid_file(full path), by default
  ``full_path.lower().endswith(tuple(extensions))``;
* extensions and is_valid_file: exactly one of them (ValueError otherwise);
* a class without a valid file: FileNotFoundError naming the classes (sorted) and
  the extensions, unless allow_empty.

Here the reference walks with os.listdir and a hand-made recursion, not os.walk.
"""
import json
import os
import pickle

import pytest

from fastloader.packed_dataset import IMG_EXTENSIONS, PackedImageFolder


def reference_samples(root, extensions=IMG_EXTENSIONS, is_valid_file=None,
                      allow_empty=False):
    if (extensions is None) == (is_valid_file is None):
        raise ValueError("Both extensions and is_valid_file cannot be None or not None "
                         "at the same time")
    root = os.path.expanduser(root) if isinstance(root, str) else root
    root = os.fspath(root)
    classes = sorted(name for name in os.listdir(root)
                     if os.path.isdir(os.path.join(root, name)))
    if not classes:
        raise FileNotFoundError(f"Couldn't find any class folder in {root}.")
    class_to_idx = {name: i for i, name in enumerate(classes)}
    endings = [extensions] if isinstance(extensions, str) else extensions
    if is_valid_file is None:
        def is_valid_file(path):
            return any(path.lower().endswith(e) for e in endings)

    def directories(top):
        """Every directory reached from `top` (links followed): (path, file names)."""
        names = os.listdir(top)
        subdirs = [n for n in names if os.path.isdir(os.path.join(top, n))]
        found = [(top, [n for n in names if n not in subdirs])]
        for n in subdirs:
            found += directories(os.path.join(top, n))
        return found

    samples = []
    empty = []
    for name in classes:
        before = len(samples)
        for dirpath, files in sorted(directories(os.path.join(root, name))):
            for f in sorted(files):
                path = os.path.join(dirpath, f)
                if is_valid_file(path):
                    samples.append((path, class_to_idx[name]))
        if len(samples) == before:
            empty.append(name)
    if empty and not allow_empty:
        msg = f"Found no valid file for the classes {', '.join(sorted(empty))}. "
        if extensions is not None:
            msg += f"Supported extensions are: {', '.join(endings)}"
        raise FileNotFoundError(msg)
    return classes, class_to_idx, samples


def make_tree(base):
    root = base / "root"
    elsewhere = base / "elsewhere"
    files = [
        # a class folder's own files come before any sub-folder's; "a b" < "a.b" < "a/..."
        "b_class/z.jpg", "b_class/A.JPG", "b_class/a/y.jpg", "b_class/a/sub/w.png",
        "b_class/a.b/x.jpg", "b_class/a b/v.jpeg", "b_class/ab/u.jpg", "b_class/a-/t.jpg",
        "b_class/notes.txt", "b_class/noext", "b_class/.hidden.jpg", "b_class/Z.Jpeg",
        "b_class/é.PNG", "b_class/É.png", "b_class/ß.jpeg", "b_class/\uff21.jpg",
        "A_class/1.jpg", "A_class/deep/er/and/deeper/2.tif", "A_class/deep/3.webp",
        "日本/写真.JPEG", "日本/サブ/画像.png",
        "empty_class/readme.txt",
        "stray.jpg",
    ]
    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode())
    for rel in ["linked_target/l1.jpg", "linked_target/inner/l2.png", "dir_target/d.jpg"]:
        p = elsewhere / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode())
    # a class that is a link to a directory; links inside a class to a directory
    # and to a file; a dangling link (a "file" to os.walk); a link to a file at the top
    os.symlink(elsewhere / "linked_target", root / "linked_class")
    os.symlink(elsewhere / "dir_target", root / "b_class" / "a.link")
    os.symlink(root / "b_class" / "z.jpg", root / "b_class" / "y_link.jpg")
    os.symlink(base / "missing.jpg", root / "b_class" / "dangling.jpg")
    os.symlink(root / "stray.jpg", root / "not_a_class")
    # a name that is not UTF-8: its code point (U+DCFF) sorts before U+FF21's, while
    # its byte (0xFF) sorts after U+FF21's first byte (0xEF)
    with open(os.path.join(os.fsencode(root / "b_class"), b"\xff.jpg"), "wb") as f:
        f.write(b"latin-1 name")
    return root


def assert_same_as_reference(ds, reference):
    classes, class_to_idx, samples = reference
    assert ds.classes == classes
    assert ds.class_to_idx == class_to_idx
    assert list(ds.samples) == samples and list(ds.imgs) == samples
    assert ds.samples == samples
    assert ds.targets == [t for _, t in samples]
    assert len(ds) == len(samples)
    assert [ds.path(i) for i in range(len(ds))] == [p for p, _ in samples]
    assert [ds.target(i) for i in range(len(ds))] == [t for _, t in samples]


def raised(fn, *args, **kwargs):
    with pytest.raises(Exception) as info:
        fn(*args, **kwargs)
    return type(info.value), str(info.value)


def test_order_and_labels_match_torchvision(tmp_path):
    root = make_tree(tmp_path)
    ref = reference_samples(str(root), allow_empty=True)
    paths = [p for p, _ in ref[2]]
    # the tree does exercise what differs from a bytewise sort of whole paths
    rel = [os.path.relpath(p, root) for p in paths]
    assert rel != sorted(rel, key=os.fsencode)
    assert rel.index("b_class/z.jpg") < rel.index("b_class/a/y.jpg")
    assert rel.index("b_class/a b/v.jpeg") < rel.index("b_class/a.b/x.jpg") \
        < rel.index("b_class/a/sub/w.png")
    assert "b_class/dangling.jpg" in rel and "linked_class/inner/l2.png" in rel
    assert rel.index(os.fsdecode(b"b_class/\xff.jpg")) < rel.index("b_class/\uff21.jpg")
    ds = PackedImageFolder(str(root), loader=lambda p: p, allow_empty=True)
    assert [os.path.join(str(root), p) for p in ds.paths] == paths   # the order first
    assert_same_as_reference(ds, ref)
    assert ds[3] == ref[2][3]   # loader(path), target
    # a pathlib root, as torchvision takes it
    assert_same_as_reference(PackedImageFolder(root, allow_empty=True),
                             reference_samples(root, allow_empty=True))


def test_empty_classes_and_argument_errors_match_torchvision(tmp_path):
    root = make_tree(tmp_path)
    ours = raised(PackedImageFolder, str(root))
    assert ours == raised(reference_samples, str(root))
    assert ours[0] is FileNotFoundError and "empty_class" in ours[1]
    # DatasetFolder-style extensions: matched against the lowercased full path
    for ext in ((".jpeg",), ".png", (".JPG",)):
        if ext == (".JPG",):   # never matches a lowercased path: every class empty
            assert raised(PackedImageFolder, root, extensions=ext) == \
                raised(reference_samples, root, extensions=ext)
            continue
        assert_same_as_reference(PackedImageFolder(root, extensions=ext, allow_empty=True),
                                 reference_samples(root, extensions=ext, allow_empty=True))

    def no_txt(path):
        return not path.endswith(".txt")

    ds = PackedImageFolder(root, is_valid_file=no_txt, allow_empty=True)
    assert ds.extensions is None
    assert_same_as_reference(ds, reference_samples(root, extensions=None, is_valid_file=no_txt,
                                                    allow_empty=True))
    ours = raised(PackedImageFolder, root, is_valid_file=no_txt)
    assert ours == raised(reference_samples, root, extensions=None, is_valid_file=no_txt)
    assert ours == (FileNotFoundError, "Found no valid file for the classes empty_class. ")
    ours = raised(PackedImageFolder, root, is_valid_file=no_txt, extensions=(".jpg",))
    assert ours == raised(reference_samples, root, extensions=(".jpg",), is_valid_file=no_txt)
    assert ours[0] is ValueError
    assert raised(PackedImageFolder, root, extensions=None) == \
        raised(reference_samples, root, extensions=None)
    (tmp_path / "no_classes").mkdir()
    (tmp_path / "no_classes" / "file.jpg").write_bytes(b"")
    ours = raised(PackedImageFolder, str(tmp_path / "no_classes"))
    assert ours == raised(reference_samples, str(tmp_path / "no_classes"))
    assert ours[0] is FileNotFoundError


def test_custom_find_classes_and_pickling(tmp_path):
    root = make_tree(tmp_path)

    class TwoClasses(PackedImageFolder):
        def find_classes(self, directory):
            return ["日本", "A_class"], {"日本": 0, "A_class": 1}

    ds = TwoClasses(root)
    _, _, samples = reference_samples(root, allow_empty=True)
    want = [(p, 0 if "日本" in p else 1) for p, _ in samples
            if os.path.relpath(p, root).split(os.sep)[0] in ("日本", "A_class")]
    assert list(ds.samples) == want   # A_class's files first: classes walk in name order
    whole = PackedImageFolder(root, allow_empty=True)
    whole.targets   # built once per process, and not pickled
    whole.samples
    data = pickle.dumps(whole)
    assert len(data) < 4096   # the packed index only (by fd/name), no list
    again = pickle.loads(data)
    assert list(again.samples) == samples
    assert again.targets == [t for _, t in samples]


# ---- samples / targets are lists, as torchvision's (review of branch lead) -------------------

def test_targets_and_samples_behave_as_torchvisions_lists(tmp_path):
    root = make_tree(tmp_path)
    _, _, ref_samples = reference_samples(str(root), allow_empty=True)
    ref_targets = [t for _, t in ref_samples]
    ds = PackedImageFolder(root, allow_empty=True, loader=os.path.basename)
    other = PackedImageFolder(root, allow_empty=True)
    for got, want in ((ds.targets, ref_targets), (ds.samples, ref_samples)):
        assert isinstance(got, list)
        assert got == want and (got == other.targets or got == other.samples)
        assert got + got == want + want           # concatenates, as lists do
        assert got.count(want[0]) == want.count(want[0])
        assert got.index(want[-1]) == want.index(want[-1])
        assert json.dumps(got) == json.dumps(want)
        assert got[1:3] == want[1:3] and list(reversed(got)) == want[::-1]
    assert all(type(t) is int for t in ds.targets)
    assert ds.imgs is ds.samples
    assert json.dumps(ds.targets[0]) == json.dumps(ref_targets[0])

    # targets: settable and changeable; as with torchvision, __getitem__ does not read it
    ds.targets[0] = 99
    assert ds.targets[0] == 99 and ds[0][1] == ref_targets[0]
    ds.targets = [7] * len(ds)
    assert ds.targets == [7] * len(ds) and ds[0][1] == ref_targets[0]

    # samples: set or changed in place, __getitem__ (and path/target) read it
    ds.samples[0] = (ref_samples[1][0], 5)
    assert ds[0] == (os.path.basename(ref_samples[1][0]), 5)
    assert ds.target(0) == 5 and ds.path(0) == ref_samples[1][0]
    copy = pickle.loads(pickle.dumps(ds))   # what a spawned worker gets
    assert copy[0] == (os.path.basename(ref_samples[1][0]), 5)
    assert copy.samples == ds.samples and copy.imgs is copy.samples
    ds.samples = [(ref_samples[2][0], 3)]
    assert ds[0] == (os.path.basename(ref_samples[2][0]), 3) and ds.samples == ds.samples[:1]
    assert len(ds.imgs) == len(ref_samples)   # torchvision's imgs stays the list it was


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_changed_samples_reach_the_workers(tmp_path, method):
    from fastloader import DataLoader

    root = make_tree(tmp_path)
    ds = PackedImageFolder(root, allow_empty=True, loader=os.path.basename)
    want = [(os.path.basename(p), t) for p, t in ds.samples]
    ds.samples[3] = (ds.samples[0][0], 42)
    want[3] = (want[0][0], 42)
    loader = DataLoader(ds, batch_size=4, num_workers=1, multiprocessing_context=method)
    got = []
    for names, labels in loader:
        got += list(zip(names, labels.tolist()))
    assert got == want


def test_length_follows_a_samples_list_set_or_changed_as_torchvisions(tmp_path):
    """torchvision's __len__ is len(self.samples): a filtered or extended samples
    list is the dataset (here the length stayed the folder's: the filtered one
    raised IndexError past its end, an appended sample was never visited)."""
    from fastloader import DataLoader

    root = make_tree(tmp_path)
    ds = PackedImageFolder(root, allow_empty=True, loader=os.path.basename)
    n = len(ds)
    ds.samples = [s for s in ds.samples if s[1] == 0]
    assert len(ds) == len(ds.samples) < n
    got = [name for names, _ in DataLoader(ds, batch_size=4, num_workers=1,
                                           multiprocessing_context="fork") for name in names]
    assert got == [os.path.basename(p) for p, _ in ds.samples]
    ds.samples.append(ds.samples[0])
    assert len(ds) == len(ds.samples) and ds[len(ds) - 1] == ds[0]
    fresh = PackedImageFolder(root, allow_empty=True)
    fresh.samples.pop()
    assert len(fresh) == n - 1


def test_copy_shares_the_lists_and_keeps_its_own_attributes_as_torchvisions(tmp_path):
    """copy.copy(ds): the same lists at first (a change in place shows in both, as
    torchvision's shared list does); one set on the copy is the copy's alone (it
    was set on the original too)."""
    import copy

    root = make_tree(tmp_path)
    ds = PackedImageFolder(root, allow_empty=True)
    n = len(ds)
    val = copy.copy(ds)
    val.samples = ds.samples[:2]
    assert (len(val), len(ds)) == (2, n) and len(ds.samples) == n
    other = copy.copy(ds)
    assert other.samples is ds.samples
    other.samples.pop()
    assert len(ds) == len(other) == n - 1
    fresh = PackedImageFolder(root, allow_empty=True)   # copied before any list is built
    twin = copy.copy(fresh)
    twin.samples.pop()
    assert twin.samples is fresh.samples and len(fresh) == len(twin) == n - 1
