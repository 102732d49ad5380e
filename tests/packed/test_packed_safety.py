"""Packed arrays against hostile input (issue 12, items 4-7).

- Another process rewrites the offsets of a loaded file or a named segment while
  this one serialises views of it (save, share, pickle): never a crash, never a
  write past a buffer (run under `make test-asan` too: the child inherits ASan).
- A sparse file that claims billions of items, and handles crafted so that the
  view bounds overflow 64-bit arithmetic: a clear ValueError, no read outside.
- Nothing from a file is unpickled unless PackedArray.load is asked by name.
- save() replaces a file (temporary file, fsync, rename), never rewrites it.

The readers that might crash run in child interpreters, so a crash fails the test
instead of killing the test run.
"""
import json
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

from fastloader import _core
from fastloader import packed as packed_mod
from fastloader.packed import PackedArray, PackedFormatError, PackedStringArray

HDR = _core.PACKED_HEADER_SIZE


def run_child(code, env, *args, timeout=300):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *map(str, args)],
                          env=env, timeout=timeout, capture_output=True)
    out, err = done.stdout.decode(), done.stderr.decode()
    assert done.returncode == 0, f"child died (rc {done.returncode}):\n{err[-3000:]}"
    assert "AddressSanitizer" not in err and "runtime error" not in err, err[-3000:]
    return out


# ---- item 4: concurrent writer ----------------------------------------------------------------

# Flips the offset table of a packed file or segment between its real values and a
# hostile but individually valid state (even items: the first 4 KiB of the data; odd
# items: inverted, so invalid). Before the fix, _serialize sized its buffer with one
# state and copied with the other: 4 KiB per item into a buffer sized for ~50 bytes.
WRITER = r"""
import mmap, os, sys, time
path, stop, parent = sys.argv[1], sys.argv[2], os.getppid()
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
count = int.from_bytes(m[16:24], "little")
data_nbytes = int.from_bytes(m[32:40], "little")
table = int.from_bytes(m[40:48], "little")
good = m[table:table + 8 * (count + 1)]
big = min(data_nbytes, 4096)
hostile = b"".join((0 if i % 2 == 0 else big).to_bytes(8, "little") for i in range(count + 1))
print("ready", flush=True)
flips = 0
deadline = time.monotonic() + 240
while time.monotonic() < deadline:
    m[table:table + len(good)] = hostile
    m[table:table + len(good)] = good
    flips += 1
    if flips % 32 == 0 and (os.path.exists(stop) or os.getppid() != parent):
        break   # done, or the reader died
print(flips, flush=True)
"""

READER = r"""
import json, os, pickle, subprocess, sys
from fastloader.packed import PackedStringArray
where, how, workdir, writer_code, rounds = sys.argv[1:6]
rounds = int(rounds)
items = [f"item-{i:06d}-" + "x" * 40 for i in range(20000)]
if how == "file":
    PackedStringArray(items).save(where)
    os.chmod(where, 0o600)   # only we can write it: loaded by mapping, what is tested
    a = PackedStringArray.load(where)
    assert a._storage.kind == "file", a._storage.kind
    target = where
else:   # a named segment of this process
    a = PackedStringArray(items, sharing_strategy="file_system")
    target = os.path.join("/dev/shm", a._storage.name)
stop = os.path.join(workdir, "stop")
writer = subprocess.Popen([sys.executable, "-c", writer_code, target, stop],
                          stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
assert writer.stdout.readline().strip() == "ready"
view = a[::2]
out_path = os.path.join(workdir, "out.fpk")
other = "file_descriptor" if a.sharing_strategy == "file_system" else "file_system"

def check(b):
    assert len(b) == len(view), (len(b), len(view))
    b.validate()   # what a serialiser produced is consistent, whatever it read

def op_pickle():
    check(pickle.loads(pickle.dumps(view)))

def op_save():
    view.save(out_path)
    check(PackedStringArray.load(out_path))

def op_share():
    check(view.share(other))

def op_read():
    view.nbytes
    view == view
    "absent" in view
    len(view.tolist())
    a.validate()

outcomes = {"ok": 0, "error": 0}
for _ in range(rounds):
    for op in (op_pickle, op_save, op_share, op_read):
        try:
            op()
        except ValueError:   # corrupt offsets seen: an exception is the promised outcome
            outcomes["error"] += 1
        else:
            outcomes["ok"] += 1
open(stop, "w").close()
flips = int(writer.stdout.readline())
assert writer.wait(60) == 0
print(json.dumps({"outcomes": outcomes, "flips": flips}))
"""


@pytest.mark.parametrize("how", ["file", "file_system segment"])
def test_serialisation_survives_a_concurrent_writer(tmp_path, subprocess_env, how):
    rounds = 60
    where = tmp_path / "names.fpk" if how == "file" else "-"
    out = run_child(READER, subprocess_env, where, how.split()[0], tmp_path, WRITER, rounds)
    result = json.loads(out.strip().splitlines()[-1])
    assert sum(result["outcomes"].values()) == 4 * rounds
    assert result["flips"] > 0, "the writer never ran: the test proved nothing"


# Rewrites one long item of a packed file in place, all of its bytes between "A"
# (ASCII) and 0xC3 (not), as fast as it can.
FLIPPER = r"""
import mmap, os, sys, time
path, start, n, stop = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
parent = os.getppid()
fd = os.open(path, os.O_RDWR)
m = mmap.mmap(fd, os.fstat(fd).st_size)
ascii_, other = b"A" * n, b"\xc3" * n
print("ready", flush=True)
deadline = time.monotonic() + 120
while (time.monotonic() < deadline and not os.path.exists(stop)
       and os.getppid() == parent):   # done, or the reader died
    for _ in range(64):
        m[start:start + n] = other
        m[start:start + n] = ascii_
"""

# CPython's UTF-8 decoder reads its input twice where it is not 8-byte aligned (an
# ASCII check, then a copy): decoded in place from the mapping, an item rewritten
# in between came out as a str marked ASCII that holds 0xC3 bytes, and using it
# (max(s), iterating it) indexes past CPython's 128-entry table: a segfault.
STR_READER = r"""
import json, os, subprocess, sys, time
from fastloader.packed import PackedStringArray
path, workdir, flipper_code = sys.argv[1:4]
n = 1 << 16
PackedStringArray(["x", "A" * n]).save(path)   # item 1 starts at an odd offset
os.chmod(path, 0o600)   # only we can write it: loaded by mapping
a = PackedStringArray.load(path)
assert a._storage.kind == "file", a._storage.kind
start = open(path, "rb").read().index(b"A" * n)
assert start % 8 != 0, start
stop = os.path.join(workdir, "stop")
flipper = subprocess.Popen([sys.executable, "-c", flipper_code, path, str(start), str(n), stop],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
assert flipper.stdout.readline().strip() == "ready"
reads, mixed, deadline = 0, 0, time.monotonic() + 4
while time.monotonic() < deadline:
    s = a[1]
    reads += 1
    if s.isascii() and max(s.encode("ascii")) >= 0x80:
        print(json.dumps({"corrupt_at": reads}))
        sys.exit(3)
    mixed += not s.isascii()
open(stop, "w").close()
assert flipper.wait(60) == 0
print(json.dumps({"reads": reads, "mixed": mixed}))
"""


def test_an_item_rewritten_while_it_is_decoded_never_comes_out_corrupt(tmp_path,
                                                                      subprocess_env):
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(STR_READER),
                           str(tmp_path / "race.fpk"), str(tmp_path), FLIPPER],
                          env=subprocess_env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, (f"a str marked ASCII holds non-ASCII bytes, or the "
                                  f"reader died (rc {done.returncode}):\n"
                                  f"{done.stdout[-500:]}{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["reads"] > 0
    assert result["mixed"] > 0, "never saw the writer's bytes: the test proved nothing"


# A loaded file cut short under its mapping kills the reader with SIGBUS, and no check
# can prevent it: a file another user could cut short is copied at load instead. The
# child cuts it short itself (a writer's identity does not matter to the kernel) and
# reads the last item, as a training process would, in the main process and in a
# worker. Before the fix: SIGBUS.
SHORTENED = r"""
import json, os, sys
import torch
from fastloader import DataLoader
from fastloader.packed import PackedStringArray
path, who, strategy = sys.argv[1:4]
items = [f"name-{i:06d}" for i in range(200000)]
PackedStringArray(items).save(path)
if who == "group-writable":
    os.chmod(path, 0o664)
    os.chown(path, -1, 65534)   # a group we are not the only member of (nogroup)
elif who == "world-writable":
    os.chmod(path, 0o666)
elif who == "another user's":
    os.chown(path, 65534, 65534)
a = PackedStringArray.load(path, sharing_strategy=strategy)
kind = a._storage.kind
os.truncate(path, 4096)
last = a[len(a) - 1]
from_worker = list(DataLoader(a[-3:], batch_size=None, num_workers=1))
print(json.dumps({"kind": kind, "last": last, "from_worker": from_worker}))
"""


@pytest.mark.parametrize("strategy", ["file_descriptor", "file_system"])
@pytest.mark.parametrize("who", ["world-writable", "group-writable", "another user's"])
def test_a_file_another_user_can_cut_short_is_copied_not_mapped(tmp_path, subprocess_env,
                                                                 who, strategy):
    if who != "world-writable" and os.geteuid() != 0:
        pytest.skip("chown to another user or group needs root")
    out = run_child(SHORTENED, subprocess_env, tmp_path / "names.fpk", who, strategy)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["kind"] == ("memfd" if strategy == "file_descriptor" else "shm"), result
    assert result["last"] == "name-199999", result
    assert result["from_worker"] == ["name-199997", "name-199998", "name-199999"], result


def test_a_file_only_we_can_write_is_still_mapped(tmp_path):
    """O(1) load stays for the common case: a file of ours, group-writable only by our
    own user private group (umask 002) if at all."""
    import grp
    import pwd

    path = tmp_path / "names.fpk"
    PackedStringArray(["a", "bb"]).save(path)
    os.chmod(path, 0o644)
    assert PackedStringArray.load(path)._storage.kind == "file"
    me = pwd.getpwuid(os.geteuid()).pw_name
    try:
        private = grp.getgrnam(me)
    except KeyError:
        private = None
    if private is not None and set(private.gr_mem) <= {me}:
        os.chown(path, -1, private.gr_gid)
        os.chmod(path, 0o664)
        assert PackedStringArray.load(path)._storage.kind == "file"


def _grant_write_by_acl(path, uid):
    """`setfacl -m u:<uid>:rw path`, written as the kernel's xattr (setfacl may be
    missing): owner rw, that user rw, group r, mask rw, others r."""
    import struct

    anyone = 0xFFFFFFFF
    entries = [(0x01, 6, anyone), (0x02, 6, uid), (0x04, 4, anyone), (0x10, 6, anyone),
               (0x20, 4, anyone)]
    os.setxattr(path, "system.posix_acl_access",
                struct.pack("<I", 2) + b"".join(struct.pack("<HHI", *e) for e in entries))


def test_a_file_an_acl_lets_another_user_write_is_copied(tmp_path, subprocess_env):
    """An ACL's grants show only in the group bits: a file of ours, group = our user
    private group, with `setfacl -m u:nobody:rw` was mapped, and nobody's truncation
    killed the reader with SIGBUS."""
    path = tmp_path / "names.fpk"
    PackedStringArray([f"name-{i:06d}" for i in range(50000)]).save(path)
    os.chmod(path, 0o644)
    try:
        _grant_write_by_acl(path, 65534)
    except OSError as exc:
        pytest.skip(f"no POSIX ACLs here: {exc}")
    assert os.stat(path).st_mode & 0o020   # the ACL's mask, in the group bits
    out = run_child(r"""
        import os, sys
        from fastloader.packed import PackedStringArray
        a = PackedStringArray.load(sys.argv[1])
        kind = a._storage.kind
        os.truncate(sys.argv[1], 4096)   # what nobody may now do
        print(kind, a[len(a) - 1])
        """, subprocess_env, path)
    assert out.split() == ["memfd", "name-049999"], out


def test_a_file_cut_short_while_it_is_copied_is_refused(tmp_path, monkeypatch):
    """The copy reads with sendfile: a file shrinking meanwhile is a short read, an
    error naming the file, and no segment is left behind."""
    path = tmp_path / "names.fpk"
    PackedStringArray([f"n{i}" for i in range(1000)]).save(path)
    os.chmod(path, 0o666)
    real = os.sendfile
    monkeypatch.setattr(os, "sendfile", lambda out, src, offset, count:
                        real(out, src, offset, min(count, 100)) if offset == 0 else 0)
    before = {n for n in os.listdir("/dev/shm") if f"pack-{os.getpid()}-" in n}
    with pytest.raises(PackedFormatError, match="truncated while it was loaded: 100 of"):
        PackedStringArray.load(path, sharing_strategy="file_system")
    after = {n for n in os.listdir("/dev/shm") if f"pack-{os.getpid()}-" in n}
    assert after == before


# ---- item 5: bounds arithmetic of huge views ----------------------------------------------------

def sparse_packed_file(path, count):
    """A valid packed file of `count` empty strings: a header, then an all-zero offset
    table that the file system stores as a hole (a 40 GB file costs no disk)."""
    total = HDR + 8 * (count + 1)
    header = (b"\x89FLPACK\n" + (1).to_bytes(4, "little") + _core.PACKED_STR.to_bytes(4, "little")
              + count.to_bytes(8, "little") + HDR.to_bytes(8, "little") + (0).to_bytes(8, "little")
              + HDR.to_bytes(8, "little") + total.to_bytes(8, "little")
              + (0x01020304).to_bytes(4, "little") + bytes(4))
    assert len(header) == HDR
    with open(path, "wb") as f:
        f.write(header)
        f.truncate(total)
    return total


def test_huge_sparse_file_and_crafted_view_bounds(tmp_path, subprocess_env):
    count = 5_000_000_000   # > 3e9: (length - 1) * step can exceed 2**63
    path = tmp_path / "huge.fpk"
    try:
        size = sparse_packed_file(path, count)
    except OSError as exc:   # pragma: no cover - a file system without sparse files
        pytest.skip(f"cannot make a {8 * count >> 30} GiB sparse file here: {exc}")
    step = count - 1
    length = -(-2**64 // step) + 1
    wrapped = (length - 1) * step - 2**64
    assert 0 <= wrapped < count and length <= count   # the pre-fix check accepted this
    out = run_child(r"""
        import os, sys
        from fastloader.packed import PackedStringArray, attach_node_handle
        path, count, step, length = sys.argv[1], *map(int, sys.argv[2:5])
        a = PackedStringArray.load(path)
        assert len(a) == count and a[-1] == "" and a[count // 2] == ""
        assert len(a[::count - 1]) == 2 and a[1::3_000_000_000].tolist() == [""] * 2
        st = os.stat(path)
        ident = (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)
        # a handle as another process would send it, with an overflowing view
        for start, stp, n in [(0, step, length), (count - 1, -step, length),
                              (1, 2**62, 3), (0, -(2**63) + 1, 2)]:
            handle = ("PackedStringArray", ("path", path, st.st_size, ident), start, stp, n)
            try:
                v = attach_node_handle(handle)
            except ValueError as exc:
                print("refused:", exc)
            else:
                print("accepted", len(v), v[2] if len(v) > 2 else v[-1])   # reads outside
        """, subprocess_env, path, count, step, length)
    lines = out.strip().splitlines()
    assert len(lines) == 4 and all(l.startswith("refused:") for l in lines), out
    assert f"does not fit {count} items" in lines[0]
    assert os.stat(path).st_blocks * 512 < 1 << 20 < size   # really sparse


def test_mapping_past_the_end_of_its_file_is_refused(tmp_path, subprocess_env):
    """A stale or crafted handle that names more bytes than the file has would map
    pages that fault with SIGBUS: the mapping is refused instead."""
    path = tmp_path / "small.fpk"
    PackedStringArray(["a", "b"]).save(path)
    out = run_child(r"""
        import os, sys
        from fastloader import _core
        fd = os.open(sys.argv[1], os.O_RDONLY)
        size = os.fstat(fd).st_size
        try:
            m = _core.PackedMapping(fd, size + 8192)
        except ValueError as exc:
            print("refused:", exc)
        else:
            print("mapped", bytes(memoryview(m)[-1:]))   # SIGBUS before the fix
        """, subprocess_env, path)
    assert out.startswith("refused:") and "cannot map" in out, out


# A FIFO put where a packed file lies (by whoever can write that directory, e.g. the
# file's owner, another user, renaming it over the path): open() of a FIFO blocks
# until its other end opens, which came before any check that refuses it.
def test_loading_a_fifo_is_refused_not_waited_for(tmp_path, subprocess_env):
    path = tmp_path / "names.fpk"
    os.mkfifo(path)
    out = run_child(r"""
        import sys
        from fastloader import packed
        try:
            packed.load(sys.argv[1])
        except packed.PackedFormatError as exc:
            print("refused:", exc)
        """, subprocess_env, path, timeout=60)
    assert "refused:" in out and "not a regular file" in out, out


def test_workers_refuse_a_loaded_file_swapped_for_a_fifo_instead_of_hanging(
        tmp_path, subprocess_env):
    """file_system: spawned workers reopen a loaded file by its path; a FIFO renamed
    over it made them block in open() for ever (the loader hung)."""
    path = tmp_path / "names.fpk"
    PackedStringArray(["a", "bb", "ccc", "dddd"]).save(path)
    script = tmp_path / "swap.py"   # a file: spawned workers import its __main__
    script.write_text(textwrap.dedent(r"""
        import os, sys
        import torch
        from fastloader import DataLoader, PackedStringArray

        class Lengths(torch.utils.data.Dataset):
            def __init__(self, names):
                self.names = names
            def __len__(self):
                return len(self.names)
            def __getitem__(self, i):
                return len(self.names[i])

        if __name__ == "__main__":
            path = sys.argv[1]
            names = PackedStringArray.load(path, sharing_strategy="file_system")
            os.mkfifo(path + ".fifo")
            os.rename(path + ".fifo", path)
            loader = DataLoader(Lengths(names), batch_size=2, num_workers=1,
                                multiprocessing_context="spawn",
                                sharing_strategy="file_system")
            try:
                list(loader)
            except Exception as exc:
                print("raised:", type(exc).__name__, exc)
        """))
    child = subprocess.run([sys.executable, str(script), str(path)], env=subprocess_env,
                           timeout=120, capture_output=True, text=True)
    assert "raised: WorkerError" in child.stdout, (child.stdout, child.stderr[-3000:])
    # the worker's own error, on its stderr: why it could not start
    assert "no longer the file the parent process mapped (not a regular file)" in child.stderr


# ---- item 6: nothing is unpickled unless asked for by name ----------------------------------------

UNPICKLED = []


def mark_unpickled(tag):
    UNPICKLED.append(tag)
    return tag


class Tripwire:
    """A record whose unpickling leaves a trace (a hostile file would run code)."""

    def __reduce__(self):
        return mark_unpickled, ("ran",)


def test_only_packed_array_load_unpickles(tmp_path):
    UNPICKLED.clear()
    rec = tmp_path / "records.fpk"
    PackedArray([Tripwire(), Tripwire()]).save(rec)
    with pytest.raises(PackedFormatError, match=r"pickled records.*PackedArray\.load\(path\)"):
        packed_mod.load(rec)
    with pytest.raises(PackedFormatError, match="pickled records, not strings") as info:
        PackedStringArray.load(rec)
    # its message recommends no loader that unpickles
    assert "PackedArray.load" not in str(info.value) and "packed.load" not in str(info.value)
    # other ways in: a pickled PackedStringArray carrying a record file's bytes, a handle
    with pytest.raises(PackedFormatError, match="pickled records"):
        packed_mod._from_bytes(PackedStringArray, rec.read_bytes(), "file_descriptor")
    st = os.stat(rec)
    handle = ("PackedStringArray",
              ("path", str(rec), st.st_size, (st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size)),
              0, 1, 2)
    with pytest.raises(ValueError, match="holds pickled records"):
        packed_mod.attach_node_handle(handle)
    assert UNPICKLED == []
    # asked for by name: the records are read (and unpickled) as the caller chose
    assert PackedArray.load(rec).tolist() == ["ran", "ran"] and UNPICKLED == ["ran", "ran"]
    names = tmp_path / "names.fpk"
    PackedStringArray(["a", "b"]).save(names)
    assert packed_mod.load(names).tolist() == ["a", "b"]
    assert type(packed_mod.load(names)) is PackedStringArray
    for doc in (PackedArray.load.__doc__, packed_mod.load.__doc__):
        assert "trust" in doc


# ---- item 7: save() replaces, never rewrites ----------------------------------------------------

def test_save_replaces_a_loaded_file_atomically(tmp_path, monkeypatch):
    path = tmp_path / "names.fpk"
    old = [f"old-{i}" for i in range(1000)]
    PackedStringArray(old).save(path)
    loaded = PackedStringArray.load(path)
    inode = os.stat(path).st_ino
    synced = []
    real_fsync = os.fsync

    def fsync(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    PackedStringArray(["new"]).save(path)
    monkeypatch.undo()
    # the loaded file is untouched: same inode, its old items, now unlinked
    st = os.fstat(loaded._storage.fd)
    assert st.st_ino == inode and st.st_nlink == 0
    assert loaded.tolist() == old
    assert os.stat(path).st_ino != inode and PackedStringArray.load(path).tolist() == ["new"]
    # the data was flushed before the rename, and the rename itself
    assert len(synced) == 2 and synced[1] == str(tmp_path), synced
    assert synced[0].startswith(str(tmp_path / ".names.fpk.")), synced
    # saving a loaded array over its own file, and a view of it
    again = PackedStringArray.load(path)
    again.save(path)
    loaded[::7].save(path)
    assert again.tolist() == ["new"] and PackedStringArray.load(path).tolist() == old[::7]
    assert sorted(os.listdir(tmp_path)) == ["names.fpk"]   # no temporary file left


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "names.fpk"
    PackedStringArray(["keep"]).save(path)
    real_write = os.write

    def full_disk(fd, data):
        real_write(fd, bytes(data)[:10])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(OSError) as info:
        PackedStringArray(["x" * 100]).save(path)
    monkeypatch.undo()
    assert info.value.errno == 28
    assert PackedStringArray.load(path).tolist() == ["keep"]
    assert sorted(os.listdir(tmp_path)) == ["names.fpk"]
