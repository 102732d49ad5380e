"""Packed arrays (issue 4): PackedStringArray, PackedArray, PackedImageFolder and the
heavy-metadata warning.

The memory tests measure real private memory (USS, from /proc/<pid>/smaps via
psutil) of live workers over a full shuffled epoch of a million names, under fork,
spawn and forkserver, and check that a plain Python list does show the growth, so
the bounds are known to discriminate.
"""
import collections.abc
import copy
import multiprocessing
import errno
import os
import pickle
import random
import signal
import stat
import subprocess
import sys
import textwrap
import time
import warnings

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import default_convert
from torch.utils.data._utils.pin_memory import pin_memory

from fastloader import DataLoader, FastLoaderError
from fastloader import packed as packed_mod
from fastloader.metadata_warning import (
    HeavyMetadataWarning, _reset_once_registry, find_heavy_metadata, warn_if_heavy_metadata,
)
from fastloader.packed import PackedArray, PackedFormatError, PackedStringArray
from fastloader.packed_dataset import PackedImageFolder
from tests.support import packed_datasets as pds
from tests.support.helpers import (collect, deadline, num_fds, release_free_heap_pages, settle,
                                   wait_until)

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

MIB = 1 << 20
METHODS = ("fork", "spawn", "forkserver")
SAMPLE_STRINGS = ["a", "", "bé", "日本語/ファイル.png", "emoji 🎉", "x" * 1000, "tab\tnew\nline",
                  "\x00nul", "last"]


def fds_now():
    settle()
    return num_fds()


# ---- PackedStringArray: the sequence ----------------------------------------------------

def test_items_lengths_and_negative_indices():
    a = PackedStringArray(SAMPLE_STRINGS)
    assert len(a) == len(SAMPLE_STRINGS)
    for i, s in enumerate(SAMPLE_STRINGS):
        assert a[i] == s and type(a[i]) is str
        assert a[i - len(SAMPLE_STRINGS)] == s
    assert a[np.int64(3)] == SAMPLE_STRINGS[3]
    assert a[torch.tensor(2)] == SAMPLE_STRINGS[2]
    for bad in (len(a), -len(a) - 1, 10**30, -10**30):
        with pytest.raises(IndexError, match="PackedStringArray index out of range"):
            a[bad]
    with pytest.raises(TypeError, match="indices must be integers or slices, not float"):
        a[1.0]


def test_slices_are_views_and_match_list_slicing():
    items = [f"s{i}" * (i % 4) for i in range(50)]
    a = PackedStringArray(items)
    rng = random.Random(4)
    cases = [(None, None, None), (None, None, -1), (3, 40, 7), (40, 3, -3), (-5, None, None),
             (100, 200, None), (0, 0, None), (None, None, 1000), (None, None, -1000)]
    cases += [(rng.randint(-60, 60), rng.randint(-60, 60), rng.choice([1, 2, 3, -1, -2, 5]))
              for _ in range(200)]
    for start, stop, step in cases:
        view = a[start:stop:step]
        expected = items[start:stop:step]
        assert view.tolist() == expected, (start, stop, step)
        assert len(view) == len(expected)
        assert type(view) is PackedStringArray
        assert view._mapping is a._mapping   # a view, not a copy
        # views of views
        assert view[1::2].tolist() == expected[1::2]
        assert view[::-1].tolist() == expected[::-1]
        if expected:
            assert view[-1] == expected[-1]


def test_iteration_contains_equality_repr_tolist_take_nbytes():
    a = PackedStringArray(SAMPLE_STRINGS)
    assert list(a) == SAMPLE_STRINGS
    assert list(reversed(a)) == SAMPLE_STRINGS[::-1]
    assert a.tolist() == SAMPLE_STRINGS
    assert a.take([0, -1, 2, 2]) == [SAMPLE_STRINGS[0], SAMPLE_STRINGS[-1]] + [SAMPLE_STRINGS[2]] * 2
    with pytest.raises(IndexError):
        a.take([0, 99])
    assert "bé" in a and "" in a and "nope" not in a and 3 not in a and "\ud800" not in a
    b = PackedStringArray(iter(SAMPLE_STRINGS))
    assert a == b and not (a != b)
    assert a == SAMPLE_STRINGS and a == tuple(SAMPLE_STRINGS)
    assert a != SAMPLE_STRINGS[:-1] and a != PackedStringArray(SAMPLE_STRINGS[:-1] + ["lasT"])
    assert a[::2] == SAMPLE_STRINGS[::2]
    assert (a == "abc") is False
    with pytest.raises(TypeError):
        hash(a)
    assert repr(PackedStringArray(["x", "y"])) == "PackedStringArray(['x', 'y'], len=2)"
    assert "..." in repr(a) and "len=9" in repr(a)
    utf8 = sum(len(s.encode()) for s in SAMPLE_STRINGS)
    assert a.nbytes == utf8 + 8 * len(SAMPLE_STRINGS)
    assert a[1:3].nbytes == len("".encode()) + len("bé".encode()) + 16
    assert a[::4].nbytes == sum(len(s.encode()) for s in SAMPLE_STRINGS[::4]) + 8 * 3
    empty = PackedStringArray([])
    assert len(empty) == 0 and empty.tolist() == [] and empty.nbytes == 0 and empty == []
    assert copy.copy(a) is a and copy.deepcopy(a) is a


@pytest.mark.parametrize("kind", ["strings", "records"])
def test_a_packed_array_reads_as_a_list_and_torch_passes_it_through(kind):
    # index/count/reversed are what a list offers besides len, [] and `in`
    items = (["b", "a", "", "b", "c", "b"] if kind == "strings"
             else [{"id": 1}, 2, [3], {"id": 1}, 2.0, None])
    a = (PackedStringArray if kind == "strings" else PackedArray)(items)
    assert list(reversed(a)) == items[::-1] and list(reversed(a[1::2])) == items[1::2][::-1]
    # (a str subclass compares as its str; a str that cannot be stored is nowhere)
    for value in items + ["zz", 7, type("Name", (str,), {})("c"), "\ud800"]:
        assert a.count(value) == items.count(value), value
        for bounds in [(), (1,), (-2,), (2, 5), (0, -1), (-100, 100), (4, 2), (99,)]:
            try:
                expected = items.index(value, *bounds)
            except ValueError:
                with pytest.raises(ValueError, match="is not in"):
                    a.index(value, *bounds)
            else:
                assert a.index(value, *bounds) == expected, (value, bounds)
        view = a[::-2]
        assert view.count(value) == items[::-2].count(value)
    # not a registered Sequence, as a NumPy array is not: torch's helpers rebuild a
    # Sequence in a batch as type(x)([...]) (a full copy into a new segment, every
    # batch; a PackedArray of collated tensors, read back unpinned), so they must
    # pass the arrays through untouched
    assert not isinstance(a, collections.abc.Sequence)
    for field in (a, a[1::2]):
        assert pin_memory(field) is field and default_convert(field) is field
        assert pin_memory({"names": field})["names"] is field
    # the way to sample: the same items random.sample() draws from the list
    for seed in range(5):
        drawn = a.take(random.Random(seed).sample(range(len(a)), 4))
        assert drawn == random.Random(seed).sample(items, 4)


def test_surrogateescaped_names_round_trip_and_lone_surrogates_are_refused():
    odd = os.fsdecode(b"caf\xe9-\xff.jpg")   # what os.listdir returns for non-UTF-8 names
    a = PackedStringArray(["ok", odd])
    assert a[1] == odd and odd in a
    with pytest.raises(ValueError, match=r"item 1 cannot be encoded as UTF-8") as info:
        PackedStringArray(["ok", "bad \ud800 surrogate"])
    assert isinstance(info.value.__cause__, UnicodeEncodeError)


# ---- constructors -----------------------------------------------------------------------------

def test_any_iterable_is_consumed_as_it_goes():
    produced = []

    def gen():
        for i in range(100_000):
            produced.append(i)
            yield f"item-{i}"

    a = PackedStringArray(gen())
    assert len(a) == 100_000 and a[99_999] == "item-99999" and a[12345] == "item-12345"
    assert PackedStringArray.from_iterable(x for x in ("a", "b")).tolist() == ["a", "b"]
    assert PackedStringArray({"k1": 1, "k2": 2}).tolist() == ["k1", "k2"]
    with pytest.raises(TypeError, match="not a single str"):
        PackedStringArray("abc")


def test_numpy_arrays_and_pandas_like_series():
    items = ["alpha", "béta", "", "gamma"]
    for arr in (np.array(items), np.array(items, dtype=object)):
        assert PackedStringArray(arr).tolist() == items
    if hasattr(np.dtypes, "StringDType"):
        assert PackedStringArray(np.array(items, dtype=np.dtypes.StringDType())).tolist() == items
    big = np.array([f"n{i}" for i in range(150_000)])   # several conversion chunks
    assert PackedStringArray(big)[140_000] == "n140000"
    with pytest.raises(TypeError, match="dtype int64"):
        PackedStringArray(np.arange(3))
    with pytest.raises(ValueError, match="1-d array"):
        PackedStringArray(np.array([items, items]))

    class SeriesLike:   # the duck type pandas provides
        def __init__(self, values):
            self.values = values

        def to_numpy(self):
            return np.array(self.values, dtype=object)

    assert PackedStringArray(SeriesLike(items)).tolist() == items
    with pytest.raises(TypeError, match="item 1 is float, not str"):
        PackedStringArray(SeriesLike(["a", float("nan")]))   # a missing value
    try:
        import pandas as pd
    except ImportError:
        return
    assert PackedStringArray(pd.Series(items)).tolist() == items
    assert PackedArray(pd.Series([{"a": 1}, {"b": 2}])).tolist() == [{"a": 1}, {"b": 2}]


def _same_items(packed, expected):
    got = packed.tolist()
    assert [type(x) for x in got] == [type(x) for x in expected], (got, expected)
    assert [repr(x) for x in got] == [repr(x) for x in expected], (got, expected)


def test_records_from_numpy_and_pandas_keep_their_values_and_types():
    """A PackedArray made of a NumPy array or a pandas column holds what the list
    would (datetimes came back as ints of ns, a nullable NA as NaN, structured
    records as bare tuples)."""
    stamps = np.array(["2020-01-01T00:00:00.000000001", "2021-05-05"], dtype="datetime64[ns]")
    _same_items(PackedArray(stamps), list(stamps))
    spans = np.array([5, 7], dtype="timedelta64[ns]")
    _same_items(PackedArray(spans), list(spans))
    rows = np.array([(1, 2.5)], dtype=[("id", "i8"), ("w", "f8")])
    assert PackedArray(rows)[0]["id"] == 1 and PackedArray(rows)[0]["w"] == 2.5
    _same_items(PackedArray(np.arange(3)), np.arange(3).tolist())   # numbers: Python's
    try:
        import pandas as pd
    except ImportError:
        return
    with pytest.raises(ValueError, match="1-d array"):   # a DataFrame passed by mistake
        PackedArray(pd.DataFrame({"path": ["a"], "label": [1]}))
    for series in (pd.Series(pd.to_datetime(["2020-01-01 00:00:00.000000001",
                                             "2021-05-05 00:00:00.000000000"])),
                   pd.Series([1, None], dtype="Int64"), pd.Series([1.5, 2.0]),
                   pd.Series(["a", None], dtype="string")):
        _same_items(PackedArray(series), list(series))
    # plain numbers and strings keep the fast path (the same items either way)
    for series in (pd.Series(range(5)), pd.Series(["a", "b"]), pd.Index([1.5, 2.5])):
        _same_items(PackedArray(series), series.to_numpy().tolist())
    try:
        import pyarrow as pa
    except ImportError:
        return
    _same_items(PackedArray(pa.array([1, 2, 3])), [1, 2, 3])   # not pyarrow's scalars


def test_from_file_lines(tmp_path, monkeypatch):
    path = tmp_path / "names.txt"
    path.write_bytes("a\nbé\r\n\nlast line".encode())
    assert PackedStringArray.from_file(path).tolist() == ["a", "bé", "", "last line"]
    path.write_bytes(b"one\ntwo\n")
    assert PackedStringArray.from_file(path).tolist() == ["one", "two"]
    path.write_bytes(b"")
    assert PackedStringArray.from_file(path).tolist() == []
    path.write_bytes(b"\n")
    assert PackedStringArray.from_file(path).tolist() == [""]
    # lines spanning read chunks, multi-byte characters cut in two
    lines = [("é" * (i % 13)) + f"-{i}" for i in range(3000)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    monkeypatch.setattr(packed_mod, "_READ_CHUNK", 7)
    assert PackedStringArray.from_file(path).tolist() == lines
    monkeypatch.undo()
    path.write_text("\n".join(lines), encoding="latin-1", errors="replace")
    assert PackedStringArray.from_file(path, encoding="latin-1").tolist() == \
        [s.encode("latin-1", "replace").decode("latin-1") for s in lines]


def test_from_file_rejects_invalid_utf8_naming_the_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nalso fine\nbroken \xff here\n")
    before = fds_now()
    with pytest.raises(ValueError, match=r"line 3 is not valid UTF-8 \(byte 7 of the line\)"):
        PackedStringArray.from_file(path)
    for bad in (b"\xc0\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"):
        path.write_bytes(b"x\n" + bad + b"\n")
        with pytest.raises(ValueError, match="line 2 is not valid UTF-8"):
            PackedStringArray.from_file(path)
    assert fds_now() == before
    with pytest.raises(FileNotFoundError):
        PackedStringArray.from_file(tmp_path / "missing.txt")


def make_tree(root):
    files = ["b/2.JPG", "b/1.jpg", "a/x/y/deep.png", "a/x/y/skip.txt", "a.jpg", "a/0.jpeg",
             "c/.hidden.jpg", "c/Ünïcode.jpg", "c d/space.png", "zz.PNG"]
    for rel in files:
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rel.encode())
    (root / "empty_dir").mkdir()
    os.symlink(root / "b" / "1.jpg", root / "c" / "link_to_file.jpg")
    os.symlink(root / "missing.jpg", root / "c" / "dangling.jpg")
    os.symlink(root, root / "a" / "loop")          # a link back to an ancestor
    os.symlink(root / "b", root / "c" / "linked_dir")
    with open(os.path.join(os.fsencode(root), b"c", b"raw-\xff.jpg"), "wb") as f:
        f.write(b"raw")
    return files


def walk_expected(root):
    """Every regular file (links to files included) below root, links to directories
    not entered, as relative paths sorted bytewise: what from_directory must give."""
    out = []
    for dirpath, _dirnames, filenames in os.walk(root, followlinks=False):
        for name in filenames:
            full = os.path.join(dirpath, name)
            if os.path.isfile(full):
                out.append(os.path.relpath(full, root))
    return sorted(out, key=os.fsencode)


def test_from_directory_sorted_filtered_links(tmp_path):
    root = tmp_path / "tree"
    make_tree(root)
    got = PackedStringArray.from_directory(root, suffixes=(".jpg", ".jpeg", ".png"))
    expected = ['a.jpg', 'a/0.jpeg', 'a/x/y/deep.png', 'b/1.jpg', 'b/2.JPG', 'c d/space.png',
                'c/.hidden.jpg', 'c/link_to_file.jpg', 'c/linked_dir/1.jpg',
                'c/linked_dir/2.JPG', os.fsdecode(b'c/raw-\xff.jpg'), 'c/Ünïcode.jpg', 'zz.PNG']
    assert got.tolist() == expected
    # the same as a Python walk, every file, links not followed into directories
    everything = PackedStringArray.from_directory(root, follow_symlinks=False)
    assert everything.tolist() == walk_expected(root)
    assert "a/x/y/skip.txt" in everything and "c/linked_dir/1.jpg" not in everything
    assert PackedStringArray.from_directory(root, suffixes=".PNG").tolist() == \
        ['a/x/y/deep.png', 'c d/space.png', 'zz.PNG']
    assert PackedStringArray.from_directory(root, suffixes=()).tolist() == []
    with pytest.raises(FileNotFoundError, match="nope"):
        PackedStringArray.from_directory(tmp_path / "nope")
    with pytest.raises(NotADirectoryError):
        PackedStringArray.from_directory(root / "a.jpg")


def test_from_directory_in_another_thread_scans_the_same(tmp_path):
    # there it does not look for Ctrl-C (only the main thread runs handlers)
    import threading

    root = tmp_path / "tree"
    make_tree(root)
    got = []
    scan = threading.Thread(target=lambda: got.append(
        PackedStringArray.from_directory(root, follow_symlinks=False).tolist()))
    scan.start()
    scan.join(60)
    assert got == [walk_expected(root)]


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any directory")
def test_from_directory_unreadable_subdirectory_is_named(tmp_path):
    (tmp_path / "ok").mkdir()
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0)
    try:
        with pytest.raises(PermissionError, match="locked"):
            PackedStringArray.from_directory(tmp_path)
    finally:
        locked.chmod(0o700)


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_ctrl_c_stops_a_scan_of_an_endless_tree_of_links_and_leaves_nothing(tmp_path, strategy):
    """40 levels of two links to the next level: 2**40 paths to one file, as
    os.walk(followlinks=True) would walk them too. The scan ran with the GIL released
    and never looked for signals: Ctrl-C could not stop it."""
    for level in range(40):
        (tmp_path / f"d{level}").mkdir()
        for link in ("a", "b"):
            os.symlink(tmp_path / f"d{level + 1}", tmp_path / f"d{level}" / link)
    (tmp_path / "d40").mkdir()
    (tmp_path / "d40" / "x.jpg").write_bytes(b"")
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent("""
        import os, sys
        from fastloader import PackedStringArray
        print("scanning", flush=True)
        try:
            PackedStringArray.from_directory(sys.argv[1], suffixes=".jpg",
                                             sharing_strategy=sys.argv[2])
        except KeyboardInterrupt:
            left = [n for n in os.listdir("/dev/shm")
                    if n.startswith(f"fastloader-pack-{os.getpid()}-")]
            print("interrupted; segments left:", left, flush=True)
        """), str(tmp_path / "d0"), strategy], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "scanning\n"
        time.sleep(1.0)   # well into the scan
        child.send_signal(signal.SIGINT)
        out, _ = child.communicate(timeout=60)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert out == "interrupted; segments left: []\n"


# ---- errors leave nothing behind ------------------------------------------------------------

@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
def test_non_str_item_names_the_item_and_leaves_nothing(strategy):
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()   # named segments use it; its pipe is one fd for good
    shm_before = set(os.listdir("/dev/shm"))
    before = fds_now()
    with pytest.raises(TypeError, match=r"PackedStringArray: item 3 is bytes, not str"):
        PackedStringArray(["a", "b", "c", b"d", "e"], sharing_strategy=strategy)
    with pytest.raises(TypeError, match=r"item 0 is NoneType, not str"):
        PackedStringArray(x for x in [None])

    def failing():
        yield "fine"
        raise KeyError("from the iterable")

    with pytest.raises(KeyError, match="from the iterable"):
        PackedStringArray(failing(), sharing_strategy=strategy)
    assert fds_now() == before
    leftovers = {n for n in set(os.listdir("/dev/shm")) - shm_before
                 if n.startswith(f"fastloader-pack-{os.getpid()}-")}
    assert not leftovers


class Unpicklable:
    def __reduce__(self):
        raise TypeError("this object refuses to be pickled")


def test_packed_array_records():
    records = [{"id": i, "bbox": [i, 2.5, 3, 4], "file_name": f"{i:06d}.jpg",
                "segmentation": [[1, 2, 3]] if i % 2 else None} for i in range(1000)]
    a = PackedArray(records)
    assert len(a) == 1000 and a[17] == records[17] and a[-1] == records[-1]
    assert a[17] is not a[17]   # a fresh object each time
    r = a[3]
    r["bbox"].append(99)
    assert a[3] == records[3]   # changing a copy changes nothing stored
    assert a[10:20].tolist() == records[10:20] and a[::-7] == records[::-7]
    assert a == records and a == PackedArray(iter(records)) and a != records[:-1]
    assert records[5] in a and {"id": -1} not in a
    assert a.take([1, 2]) == records[1:3]
    assert PackedArray([(1, "x"), None, 3.5, np.arange(3).tolist()]).tolist() == \
        [(1, "x"), None, 3.5, [0, 1, 2]]


@pytest.mark.parametrize("bad,match", [
    (lambda: None, r"item 2 \(of type function\) cannot be pickled"),
    (Unpicklable(), r"item 2 \(of type Unpicklable\) cannot be pickled"),
])
def test_unpicklable_record_names_the_item_and_leaves_nothing(bad, match):
    before = fds_now()
    with pytest.raises(pickle.PicklingError, match=match) as info:
        PackedArray([{"a": 1}, {"b": 2}, bad, {"c": 3}])
    assert info.value.__cause__ is not None
    assert fds_now() == before


# ---- pickling --------------------------------------------------------------------------------

def test_plain_pickle_carries_the_data():
    a = PackedStringArray(SAMPLE_STRINGS)
    for protocol in range(2, pickle.HIGHEST_PROTOCOL + 1):
        b = pickle.loads(pickle.dumps(a, protocol=protocol))
        assert b == a and type(b) is PackedStringArray and b._mapping is not a._mapping
    view = a[::-2]
    assert pickle.loads(pickle.dumps(view)) == SAMPLE_STRINGS[::-2]
    r = PackedArray([{"k": i} for i in range(10)])[2:5]
    assert pickle.loads(pickle.dumps(r)).tolist() == [{"k": 2}, {"k": 3}, {"k": 4}]
    fs = PackedStringArray(["x"], sharing_strategy="file_system")
    assert pickle.loads(pickle.dumps(fs)).sharing_strategy == "file_system"
    with pytest.raises(PackedFormatError, match="truncated"):
        packed_mod._from_bytes(PackedStringArray, pickle.dumps(a)[:10], "file_descriptor")


class _FakePopen:
    """Stands in for the Popen that multiprocessing uses while it starts a child."""

    def __init__(self):
        self.fds = []

    def duplicate_for_child(self, fd):
        self.fds.append(fd)
        return fd

    def DupFd(self, fd):
        return ("dupfd", fd)


def test_pickling_during_process_start_sends_a_handle_not_the_data():
    from multiprocessing import context

    a = PackedStringArray(pds.make_names(100_000))
    inline = len(pickle.dumps(a))
    assert inline > a.nbytes
    popen = _FakePopen()
    context.set_spawning_popen(popen)
    try:
        handle = pickle.dumps(a[10:])
        named = pickle.dumps(PackedStringArray(["x"], sharing_strategy="file_system"))
    finally:
        context.set_spawning_popen(None)
    assert len(handle) < 300, len(handle)
    assert popen.fds == [a._storage.fd]
    assert b"fastloader-pack-" in named and len(popen.fds) == 1   # by name, no fd


@pytest.mark.parametrize("method,strategy", [("spawn", "file_system"),
                                             ("forkserver", "file_descriptor")])
def test_child_process_attaches_to_the_same_pages(method, strategy):
    ctx = multiprocessing.get_context(method)
    names = PackedStringArray(pds.make_names(1000), sharing_strategy=strategy)
    view = names[5:-5]
    q = ctx.Queue()
    proc = ctx.Process(target=pds.child_main, args=(view, q))
    with deadline(60):
        proc.start()
        n, first, last, kind, pid = q.get(timeout=60)
        proc.join(30)
    assert (n, first, last, kind) == (990, view[0], view[-1], "PackedStringArray")
    assert proc.exitcode == 0 and pid != os.getpid()


def test_node_handle_lets_an_unrelated_process_attach(subprocess_env):
    """What fastloader.distributed.share_on_node exchanges between local ranks."""
    arrays = [PackedStringArray(pds.make_names(50))[3:40:2],
              PackedArray([{"a": i} for i in range(5)], sharing_strategy="file_system")]
    code = ("import pickle, sys\n"
            "from fastloader.packed import attach_node_handle\n"
            "handles = pickle.load(sys.stdin.buffer)\n"
            "print(repr([attach_node_handle(h).tolist() for h in handles]))\n")
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env, timeout=60,
                          input=pickle.dumps([a.node_handle() for a in arrays]),
                          capture_output=True)
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert eval(done.stdout.decode()) == [a.tolist() for a in arrays]
    with pytest.raises(FastLoaderError, match="cannot attach"):
        packed_mod.attach_node_handle(("PackedStringArray", ("procfd", 2**22 + 7, 3, 100, (0, 0)),
                                       0, 1, 1))


# ---- segments: memfd, named, files -------------------------------------------------------------

def test_memfd_segment_is_sealed_and_freed():
    before = fds_now()
    a = PackedStringArray(["x", "y"])
    st = a._storage
    assert st.kind == "memfd" and os.readlink(f"/proc/self/fd/{st.fd}").startswith("/memfd:")
    with pytest.raises(PermissionError):
        os.write(st.fd, b"overwrite")          # sealed: nobody can change the items
    with pytest.raises(PermissionError):
        os.ftruncate(st.fd, 1)
    assert fds_now() == before + 1              # one fd per array, not per view
    views = [a[i:] for i in range(10)]
    assert fds_now() == before + 1
    del a, st, views
    assert fds_now() == before


def test_file_system_segment_is_named_owner_only_and_unlinked():
    a = PackedStringArray(["x", "y"], sharing_strategy="file_system")
    name = a._storage.name
    path = os.path.join("/dev/shm", name)
    assert name.startswith(f"fastloader-pack-{os.getpid()}-")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert a._storage.fd == -1                  # reopened by name: no fd kept
    b = a.share("file_descriptor")
    assert b == a and b.sharing_strategy == "file_descriptor" and a.share("file_system") is a
    view = a[1:]
    del a
    settle()
    assert os.path.exists(path)                 # a view still uses it
    del view
    settle()
    assert not os.path.exists(path)


def test_named_segment_is_removed_when_its_creator_is_killed(subprocess_env):
    code = textwrap.dedent("""
        import os, signal, sys
        from fastloader.packed import PackedStringArray
        a = PackedStringArray(["x"] * 1000, sharing_strategy="file_system")
        print(a._storage.name, flush=True)
        sys.stdin.readline()
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=subprocess_env)
    name = proc.stdout.readline().decode().strip()
    path = os.path.join("/dev/shm", name)
    assert name.startswith("fastloader-pack-") and os.path.exists(path)
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    proc.wait(30)
    assert proc.returncode == -signal.SIGKILL
    assert wait_until(lambda: not os.path.exists(path), 10), f"{path} left behind"
    proc.stdout.close()
    proc.stdin.close()
    proc.stderr.close()


def test_save_and_load(tmp_path):
    a = PackedStringArray(SAMPLE_STRINGS)
    path = tmp_path / "names.fpk"
    a.save(path)
    b = PackedStringArray.load(path)
    assert b == a and b._storage.kind == "file"
    with open("/proc/self/maps") as maps:
        assert str(path) in maps.read()   # mapped, not read
    a[::-3].save(tmp_path / "view.fpk")
    assert packed_mod.load(tmp_path / "view.fpk").tolist() == SAMPLE_STRINGS[::-3]
    r = PackedArray([{"i": i} for i in range(100)])
    r.save(tmp_path / "rec.fpk")
    loaded = PackedArray.load(tmp_path / "rec.fpk")
    assert type(loaded) is PackedArray and loaded == r
    with pytest.raises(PackedFormatError, match="holds strings, not pickled records"):
        PackedArray.load(path)
    # saving over a loaded file replaces it: the loaded array keeps its items
    PackedStringArray(["new"]).save(path)
    assert b == a and PackedStringArray.load(path).tolist() == ["new"]
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]
    # shared under file_system by path, under file_descriptor by fd
    assert PackedStringArray.load(path, sharing_strategy="file_system")._storage.fd == -1
    assert PackedStringArray.load(path, populate=True)[0] == "new"
    with pytest.raises(FileNotFoundError):
        a.save(tmp_path / "no" / "such" / "dir.fpk")
    with pytest.raises(ValueError, match="sharing_strategy should be one of"):
        PackedStringArray(["x"], sharing_strategy="bogus")


def test_load_of_a_big_index_is_immediate(tmp_path):
    path = tmp_path / "big.fpk"
    PackedStringArray(pds.make_names(1_000_000)).save(path)
    # CPU time, not wall time: another process's load must not fail it (parsing or
    # copying the 1M-name index would take several times this)
    t = time.process_time()
    a = PackedStringArray.load(path)
    elapsed = time.process_time() - t
    assert a[999_999] == pds.make_names(1, 999_999)[0]
    assert elapsed < 0.05, f"load took {elapsed * 1000:.1f} ms of CPU"


def test_truncated_foreign_and_corrupt_files(tmp_path):
    good = tmp_path / "good.fpk"
    PackedStringArray(["alpha", "beta", "gamma"]).save(good)
    data = good.read_bytes()
    bad = tmp_path / "bad.fpk"
    cases = [
        (data[:10], r"truncated: 10 bytes, shorter than the 64-byte header"),
        (data[:-8], rf"truncated: the header says {len(data)} bytes, only {len(data) - 8} are there"),
        (data[:70], rf"truncated: the header says {len(data)} bytes, only 70 are there"),
        (data + b"junk", "trailing data"),
        (b"\x89PNG\r\n\x1a\n" + b"\0" * 100, "not a fastloader packed array"),
        (b"name one\nname two\n" * 10, "not a fastloader packed array"),
        (data[:8] + (7).to_bytes(4, "little") + data[12:], "format version 7"),
        (data[:12] + (9).to_bytes(4, "little") + data[16:], "unknown item kind 9"),
        (data[:16] + (10**6).to_bytes(8, "little") + data[24:], "corrupt header"),
        (data[:-8] + (999).to_bytes(8, "little"), "corrupt offset table"),
    ]
    for content, match in cases:
        bad.write_bytes(content)
        with pytest.raises(PackedFormatError, match=match) as info:
            PackedStringArray.load(bad)
        assert str(bad) in str(info.value)
    bad.write_bytes(b"")
    with pytest.raises(PackedFormatError, match="truncated: 0 bytes"):
        packed_mod.load(bad)
    # a bad offset in the middle: loading is O(1), so the item itself says so
    table = len(data) - 4 * 8
    corrupt = bytearray(data)
    corrupt[table + 8:table + 16] = (1 << 40).to_bytes(8, "little")
    bad.write_bytes(bytes(corrupt))
    arr = PackedStringArray.load(bad)
    assert arr[2] == "gamma"
    with pytest.raises(ValueError, match=r"corrupt at item 0: offsets 0\.\.1099511627776"):
        arr[0]
    with pytest.raises(ValueError, match="corrupt at item 0"):
        arr.validate()
    PackedStringArray.load(good).validate()


def test_random_corruption_gives_exceptions_never_crashes(tmp_path):
    """Flip bytes anywhere in a saved file: loading and reading every item either
    works or raises ValueError (PackedFormatError is one); it never reads outside
    the mapping (run under `make test-asan` too)."""
    good = tmp_path / "good.fpk"
    PackedStringArray([f"item-{i}-" + "é" * (i % 5) for i in range(40)]).save(good)
    data = good.read_bytes()
    rng = random.Random(1234)
    bad = tmp_path / "bad.fpk"
    outcomes = set()
    for _ in range(300):
        corrupt = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            corrupt[rng.randrange(len(corrupt))] = rng.randrange(256)
        bad.write_bytes(bytes(corrupt))
        try:
            arr = PackedStringArray.load(bad)
            for i in range(len(arr)):
                arr[i]
            arr[::-3].tolist()
            arr.validate()
            outcomes.add("ok")
        except ValueError:
            outcomes.add("error")
    assert outcomes == {"ok", "error"}


# ---- through DataLoader ---------------------------------------------------------------------

def batches_of(items, batch_size):
    return [items[i:i + batch_size] for i in range(0, len(items), batch_size)]


def test_loader_strings_fork_and_records_forkserver():
    names = pds.make_names(300)
    loader = DataLoader(pds.ItemDataset(PackedStringArray(names)), batch_size=16, num_workers=2,
                        multiprocessing_context="fork")
    assert collect(loader) == batches_of(names, 16)
    records = [{"bbox": [i, i + 1.5, 2, 3], "category_id": i % 80, "file_name": f"{i}.jpg"}
               for i in range(100)]
    loader = DataLoader(pds.RecordDataset(PackedArray(records, sharing_strategy="file_system")),
                        batch_size=10, num_workers=2, multiprocessing_context="forkserver")
    got = collect(loader, seconds=90)
    assert len(got) == 10
    for k, (bbox, cat, fname) in enumerate(got):
        chunk = records[10 * k:10 * k + 10]
        assert torch.equal(bbox, torch.tensor([r["bbox"] for r in chunk], dtype=torch.float32))
        assert cat.tolist() == [r["category_id"] for r in chunk]
        assert list(fname) == [r["file_name"] for r in chunk]


# ---- PackedImageFolder ------------------------------------------------------------------------

def make_image_tree(root):
    layout = {"dog": ["b.jpg", "a.PNG", "sub/c.jpeg", "notes.txt"], "cat": ["1.jpg", "2.jpg"],
              "cat.x": ["z.jpg"], "emu": ["sub/deeper/e.bmp"]}
    for cls, files in layout.items():
        for f in files:
            p = root / cls / f
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_bytes(f"{cls}/{f}".encode())
    (root / "stray.jpg").write_bytes(b"not in a class")
    return layout


def test_packed_image_folder(tmp_path):
    make_image_tree(tmp_path)
    ds = PackedImageFolder(tmp_path, loader=pds.read_size, target_transform=lambda t: t * 10)
    assert ds.classes == ["cat", "cat.x", "dog", "emu"]
    assert ds.class_to_idx == {"cat": 0, "cat.x": 1, "dog": 2, "emu": 3}
    assert ds.paths.tolist() == ["cat/1.jpg", "cat/2.jpg", "cat.x/z.jpg", "dog/a.PNG",
                                 "dog/b.jpg", "dog/sub/c.jpeg", "emu/sub/deeper/e.bmp"]
    assert ds.targets == [0, 0, 1, 2, 2, 2, 3] and type(ds.targets[0]) is int
    assert len(ds) == 7 and [ds.target(i) for i in range(7)] == ds.targets
    sample, target = ds[5]
    assert target == 20 and sample.tolist() == [len(b"dog/sub/c.jpeg"), ord("d")]
    assert ds[-1][1] == 30 and ds.path(-1) == os.path.join(str(tmp_path), "emu/sub/deeper/e.bmp")
    with pytest.raises(IndexError):
        ds[7]
    assert find_heavy_metadata(ds) == []
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no valid file for the classes empty"):
        PackedImageFolder(tmp_path)
    assert len(PackedImageFolder(tmp_path, allow_empty=True, is_valid_file=lambda p: True)) == 8
    with pytest.raises(FileNotFoundError, match="Couldn't find any class folder"):
        PackedImageFolder(tmp_path / "empty")


def test_packed_image_folder_through_a_spawn_loader(tmp_path):
    make_image_tree(tmp_path)
    ds = PackedImageFolder(tmp_path, loader=pds.read_size)
    loader = DataLoader(ds, batch_size=3, num_workers=2, multiprocessing_context="spawn")
    got = collect(loader, seconds=90)
    samples = torch.cat([b[0] for b in got])
    assert torch.cat([b[1] for b in got]).tolist() == ds.targets
    assert samples[:, 0].tolist() == [os.path.getsize(ds.path(i)) for i in range(len(ds))]


# ---- the heavy-metadata warning -----------------------------------------------------------------

class HolderDataset(torch.utils.data.Dataset):
    def __init__(self, **attrs):
        self.__dict__.update(attrs)

    def __len__(self):
        return 1

    def __getitem__(self, i):
        return i


@pytest.fixture
def fresh_warning_registry():
    _reset_once_registry()
    yield
    _reset_once_registry()


def test_warning_names_attribute_cost_and_fix(fresh_warning_registry):
    ds = HolderDataset(names=pds.make_names(150_000), small=list(range(10)), n=3)
    with pytest.warns(HeavyMetadataWarning) as record:
        found = warn_if_heavy_metadata(ds, 4, "fork")
    assert len(record) == 1 and [f.path for f in found] == ["dataset.names"]
    message = str(record[0].message)
    assert "`dataset.names`" in message and "HolderDataset" in message
    assert "list of 150,000 items" in message and "MiB per worker" in message
    assert "fastloader.PackedStringArray(names)" in message and "4 DataLoader workers" in message
    assert record[0].filename == __file__   # points at the caller, not at fastloader
    mib = found[0].nbytes / MIB
    assert 8 < mib < 20, mib                  # 150k ~40-char str: ~12 MiB
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_heavy_metadata(ds, 4, "fork")   # once
        assert warn_if_heavy_metadata(ds, 0, "fork") == []
        warn_if_heavy_metadata(HolderDataset(names=PackedStringArray(pds.make_names(200_000))),
                               2, "spawn")


def test_warning_finds_nested_dicts_tuples_and_object_arrays(fresh_warning_registry):
    records = {i: {"bbox": [1.0, 2.0, 3.0, 4.0], "id": i} for i in range(120_000)}
    inner = HolderDataset(annotations=records)
    outer = torch.utils.data.Subset(inner, [0])
    concat = torch.utils.data.ConcatDataset([HolderDataset(t=tuple(range(200_000))), outer])
    with pytest.warns(HeavyMetadataWarning) as record:
        found = warn_if_heavy_metadata(concat, 2, multiprocessing.get_context("spawn"))
    paths = sorted(f.path for f in found)
    assert paths == ["dataset.datasets[0].t", "dataset.datasets[1].dataset.annotations"]
    text = " ".join(str(r.message) for r in record)
    assert "'spawn' worker unpickles its own copy" in text and "PackedArray(annotations)" in text
    big = HolderDataset(blob=[bytes([i]) * MIB for i in range(70)])   # few items, many MiB
    objs = HolderDataset(arr=np.array([f"s{i}" for i in range(150_000)], dtype=object))
    fixed = HolderDataset(arr=np.array([f"s{i}" for i in range(150_000)]))  # no objects
    with pytest.warns(HeavyMetadataWarning):
        assert [f.path for f in warn_if_heavy_metadata(big, 1, "fork")] == ["dataset.blob"]
    with pytest.warns(HeavyMetadataWarning, match="NumPy array of Python objects"):
        warn_if_heavy_metadata(objs, 1, "fork")
    assert find_heavy_metadata(fixed) == []
    with pytest.warns(HeavyMetadataWarning, match=r"a NumPy array \(np.asarray\(indices\)\)"):
        warn_if_heavy_metadata(torch.utils.data.Subset(fixed, list(range(10**6, 10**6 + 150_000))),
                               2, "fork")
    with pytest.warns(HeavyMetadataWarning, match=r"`dataset` \(the dataset itself\) is a Python "
                                                  r"list of 150,000 items"):
        warn_if_heavy_metadata(pds.make_names(150_000), 2, "forkserver")


def test_loader_warns_once_when_it_starts_workers(fresh_warning_registry):
    ds = pds.NamesDataset(pds.make_names(120_000))
    loader = DataLoader(ds, batch_size=4096, num_workers=1, multiprocessing_context="fork")
    with pytest.warns(HeavyMetadataWarning, match=r"`dataset.names` \(NamesDataset\)") as record:
        it = iter(loader)
        next(it)
        del it
    assert len(record) == 1 and record[0].filename == __file__
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        collect(loader)
        collect(DataLoader(ds, batch_size=4096, num_workers=0))


# ---- memory: the point of it all ---------------------------------------------------------------

N_NAMES = 1_000_000
GROWTH_BOUND = 2 * MIB
EXCESS_BOUND = 8 * MIB
WARMUP_BATCHES = 16


@pytest.fixture(scope="module")
def million_names():
    names = pds.make_names(N_NAMES)
    return names, PackedStringArray(names)


_baselines = {}


def no_names_end(method):
    """End-of-epoch USS of workers whose dataset holds no names (once per method)."""
    if method not in _baselines:
        _, end = epoch_memory(pds.NoNamesDataset(N_NAMES), method, 40 * N_NAMES)
        _baselines[method] = end
    return _baselines[method]


def uss(pid):
    return psutil.Process(pid).memory_full_info().uss


def epoch_memory(dataset, method, expected_sum):
    """USS of each worker after a warm-up and at the end of one full shuffled epoch
    (persistent workers stay alive to be measured)."""
    release_free_heap_pages()
    loader = DataLoader(dataset, batch_size=1024, shuffle=True, num_workers=2,
                        multiprocessing_context=method, persistent_workers=True)
    with deadline(120, f"{method} epoch"):
        it = iter(loader)
        total = 0
        for _ in range(WARMUP_BATCHES):
            total += int(next(it).sum())
        pids = it.worker_pids
        start = [uss(p) for p in pids]
        for batch in it:
            total += int(batch.sum())
        end = [uss(p) for p in pids]
    it._shutdown_workers()
    del it, loader
    settle()
    assert total == expected_sum   # every item was read, in a shuffled order
    return start, end


def fmt(values):
    return "[" + ", ".join(f"{v / MIB:.2f}" for v in values) + "] MiB"


# AddressSanitizer's shadow memory and quarantine are private memory that grows with
# every read: `make test-asan` sets FASTLOADER_ASAN, and the bounds do not apply there.
not_under_asan = pytest.mark.skipif(bool(os.environ.get("FASTLOADER_ASAN")),
                                    reason="USS bounds do not hold under AddressSanitizer")


@not_under_asan
@pytest.mark.parametrize("method", METHODS)
def test_worker_private_memory_stays_flat_with_packed_names(method, million_names):
    names, packed = million_names
    start, end = epoch_memory(pds.NamesDataset(packed), method, sum(len(s) for s in names))
    growth = [e - s for s, e in zip(start, end)]
    assert max(growth) <= GROWTH_BOUND, f"{method}: USS growth {fmt(growth)} (start {fmt(start)})"
    base_end = no_names_end(method)
    excess = [e - min(base_end) for e in end]
    assert max(excess) <= EXCESS_BOUND, \
        f"{method}: packed workers {fmt(end)} vs workers without names {fmt(base_end)}"


@not_under_asan
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_python_list_shows_the_cost_the_bounds_catch(method, million_names):
    names, _ = million_names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", HeavyMetadataWarning)
        start, end = epoch_memory(pds.NamesDataset(names), method, sum(len(s) for s in names))
    if method == "fork":   # copy-on-read: the pages of the strings read get copied
        growth = [e - s for s, e in zip(start, end)]
        assert min(growth) > 16 * GROWTH_BOUND, f"list growth only {fmt(growth)}"
    else:                  # unpickled at start-up: private from the beginning
        excess = [e - min(no_names_end(method)) for e in end]
        assert min(excess) > 4 * EXCESS_BOUND, f"list excess only {fmt(excess)}"


def test_from_directory_error_names_the_root_as_given(tmp_path):
    missing = tmp_path / "missing"
    for root in (str(missing), missing):
        with pytest.raises(FileNotFoundError) as info:
            PackedStringArray.from_directory(root)
        assert info.value.filename == str(missing) and info.value.errno == errno.ENOENT
    with pytest.raises(FileNotFoundError) as info:
        PackedStringArray.from_directory(os.fsencode(missing))
    assert info.value.filename == os.fsencode(missing)   # bytes in, bytes out (as os.*)


def test_save_errors_name_the_target_not_the_temporary_file(tmp_path):
    target = tmp_path / "no_such_dir" / "names.fpk"
    with pytest.raises(FileNotFoundError) as info:
        PackedStringArray(["x"]).save(target)
    assert info.value.filename == str(target) and info.value.filename2 is None
    assert ".tmp" not in str(info.value) and str(target) in str(info.value)
    (tmp_path / "a_dir.fpk").mkdir()   # os.replace over a directory fails
    with pytest.raises(IsADirectoryError) as info:
        PackedStringArray(["x"]).save(tmp_path / "a_dir.fpk")
    assert info.value.filename == str(tmp_path / "a_dir.fpk") and ".tmp" not in str(info.value)
    assert sorted(os.listdir(tmp_path)) == ["a_dir.fpk"]   # no temporary file left
