"""Errors keep their identity: an OSError raised by the C core carries errno and the
file or segment name, and is of the matching subclass (FileNotFoundError,
PermissionError, ...), as any OSError Python raises itself."""
import errno
import json
import os
import pwd

import pytest

from fastloader import PackedStringArray, _core


def segment_handle(name):
    """A control-block handle naming the file_system segment `name`."""
    return {"worker_id": 0, "strategy": _core.STRATEGY_FS, "ctl_size": 1 << 20,
            "ctl_name": name, "ctl_dev": 0, "ctl_ino": 0,
            "prefix": f"fastloader-test-errors-{os.getpid()}-w0", "main_pid": os.getpid()}


def attach(handle):
    return _core.WorkerChannel(handle, -1, -1, -1, -1, 4)


def test_missing_segment_is_file_not_found_with_errno_and_name():
    name = f"/fastloader-test-errors-{os.getpid()}-missing-ctl"
    with pytest.raises(FileNotFoundError) as info:
        attach(segment_handle(name))
    assert info.value.errno == errno.ENOENT
    assert info.value.filename == name
    assert "control block" in str(info.value)


def test_mapping_a_bad_fd_carries_errno():
    r, w = os.pipe()
    os.close(w)
    try:
        with pytest.raises(OSError) as info:
            _core.PackedMapping(r, 4096)   # a pipe cannot be mapped
    finally:
        os.close(r)
    assert info.value.errno == errno.ENODEV, info.value
    assert "packed array" in str(info.value)


def test_writing_to_a_read_only_fd_carries_errno(tmp_path):
    path = tmp_path / "ro"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDONLY)
    try:
        w = _core.PackedWriter(fd, _core.PACKED_STR)
        with pytest.raises(OSError) as info:
            w.extend(["x" * (5 << 20)])   # bigger than the write buffer: written at once
    finally:
        os.close(fd)
    assert info.value.errno == errno.EBADF, info.value
    assert "bytes so far" in str(info.value)


def test_loading_a_missing_packed_file_is_file_not_found(tmp_path):
    path = str(tmp_path / "missing.fpk")
    with pytest.raises(FileNotFoundError) as info:
        PackedStringArray.load(path)
    assert info.value.errno == errno.ENOENT and info.value.filename == path


def _as_nobody(fn):
    """Run fn() in a forked child that dropped to uid `nobody`; returns its JSON."""
    try:
        nobody = pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    if os.geteuid() != 0:
        pytest.skip("changing uid needs root")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:   # pragma: no cover - child
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(nobody.pw_gid)
            os.setuid(nobody.pw_uid)
            out = json.dumps(fn())
        except BaseException as exc:
            out = json.dumps({"setup_error": repr(exc)})
        try:
            os.write(w, out.encode())
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    got = json.loads(data)
    assert "setup_error" not in got, got
    return got


def _describe(fn):
    try:
        fn()
    except BaseException as exc:
        filename = getattr(exc, "filename", None)
        return {"type": type(exc).__name__, "errno": getattr(exc, "errno", None),
                "filename": os.fsdecode(filename) if filename is not None else None,
                "message": str(exc)}
    return {"type": None}


def test_another_users_segment_is_permission_error_with_its_name():
    """A segment of another user (mode 0600) cannot be opened: PermissionError
    naming it, not an anonymous OSError."""
    main = _core.MainChannel(0, _core.STRATEGY_FS, f"fastloader-test-errors-{os.getpid()}",
                             1 << 12, 8)
    try:
        handle = main.handle()
        got = _as_nobody(lambda: _describe(lambda: attach(dict(handle))))
    finally:
        main.close()
    assert got["type"] == "PermissionError", got
    assert got["errno"] == errno.EACCES
    assert got["filename"] == handle["ctl_name"]


def test_unreadable_directory_is_permission_error(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    (secret / "a.jpg").write_bytes(b"")
    secret.chmod(0o700)
    tmp_path.chmod(0o755)
    got = _as_nobody(lambda: _describe(
        lambda: PackedStringArray.from_directory(str(secret))))
    assert got["type"] == "PermissionError", got
    assert got["errno"] == errno.EACCES
    assert got["filename"] == str(secret)
