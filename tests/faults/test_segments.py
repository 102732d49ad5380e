"""Shared-memory segments are private: file_system segments are 0600 and unlinked once
mapped, file_descriptor batches never touch /dev/shm, and (as root) another user can
open none of a loader's segments, fds or mapped files.

Every wait runs under `deadline` (SIGALRM) or a subprocess timeout, and
faulthandler_timeout (pyproject) dumps stacks if all else fails.
"""
import errno
import glob
import json
import os
import stat
import warnings

import pytest
import torch

from fastloader import DataLoader
from tests.support import datasets as ds
from tests.support import reliability_datasets as rd
from tests.support.fault_helpers import QUIET_WORKER_COUNT_WARNING, STRATEGIES, _my_shm
from tests.support.helpers import (
    assert_no_shm_left, deadline, map_lines, settle, shm_names, wait_until,
)

pytestmark = [QUIET_WORKER_COUNT_WARNING]


def test_file_system_segments_are_private_and_unlinked():
    """Named segments: /dev/shm/fastloader-*, mode 0600, unlinked once both sides mapped
    them, so every such mapping of ours is already '(deleted)' and none is left after."""
    shm_before = shm_names()
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy="file_system")
    held = []
    with deadline(30):
        it = iter(loader)
        held.extend([next(it), next(it), next(it)])
    ours = [line for line in map_lines() if "/dev/shm/fastloader-" in line]
    assert ours, "file_system strategy, yet no /dev/shm/fastloader-* segment is mapped"
    for line in ours:
        assert line.endswith("(deleted)"), f"mapped segment not unlinked: {line}"
        addresses = line.split()[0]
        try:
            mode = os.stat(f"/proc/self/map_files/{addresses}").st_mode
        except PermissionError:
            continue  # map_files needs CAP_SYS_ADMIN on some kernels
        assert stat.S_IMODE(mode) == 0o600, f"{line}: mode {oct(stat.S_IMODE(mode))}"
    del it, loader, held
    settle()
    assert_no_shm_left(shm_before)


def test_file_descriptor_strategy_stays_out_of_dev_shm():
    def shm_mappings():  # POSIX semaphores (/dev/shm/sem.*) are not data segments
        return {line.split(None, 5)[-1] for line in map_lines()
                if "/dev/shm/" in line and "/dev/shm/sem." not in line}

    before = shm_mappings()
    shm_before = shm_names()
    loader = DataLoader(ds.TensorLabelDataset(n=40), batch_size=4, num_workers=2,
                        multiprocessing_context="fork", sharing_strategy="file_descriptor")
    with deadline(30):
        it = iter(loader)
        held = [next(it), next(it), next(it)]
        after = shm_mappings()
        assert not (after - before), f"file_descriptor batches mapped from /dev/shm: {after - before}"
        assert not _my_shm() - shm_before   # this process's names: no other's at this moment
    del it, loader, held


def _probe_as_nobody(paths):
    """Fork a child that drops to uid/gid 65534 and tries to open every path for
    reading and for writing; returns {path: [errno name or "opened", ...]}."""
    read_end, write_end = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)   # fork with threads (3.12+)
        pid = os.fork()
    if pid == 0:   # pragma: no cover - the child
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            results = {"uid": os.getuid(), "euid": os.geteuid()}
            fd = os.open("/dev/null", os.O_RDONLY)   # the child can open what it may
            os.close(fd)
            for path in paths:
                outcome = []
                for flags in (os.O_RDONLY, os.O_RDWR):
                    try:
                        fd = os.open(path, flags)
                    except OSError as exc:
                        outcome.append(errno.errorcode.get(exc.errno, str(exc.errno)))
                    else:
                        os.close(fd)
                        outcome.append("opened")
                results[path] = outcome
            os.write(write_end, json.dumps(results).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    chunks = []
    with deadline(30, "the unprivileged prober"):
        while True:
            chunk = os.read(read_end, 1 << 16)
            if not chunk:
                break
            chunks.append(chunk)
        _, status = os.waitpid(pid, 0)
    os.close(read_end)
    assert os.waitstatus_to_exitcode(status) == 0, "the prober failed"
    return json.loads(b"".join(chunks))


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_segments_are_owner_only(strategy):
    """While a loader holds batches (ring slots and overflow segments, with more
    published but not taken), another user can open none of its /dev/shm segments,
    nor any fd or mapped file of the main process or its worker through /proc."""
    loader = DataLoader(rd.SmallDataset(n=400, width=1024), batch_size=4, num_workers=1,
                        multiprocessing_context="fork", sharing_strategy=strategy)
    with deadline(30):
        it = iter(loader)
        held = [next(it) for _ in range(8)]   # 5 slots: the rest are overflow segments
        prefix = it._pool.prefix
        if strategy == "file_system":
            assert wait_until(lambda: glob.glob(f"/dev/shm/{prefix}-*"), 5), \
                "no named segment pending"
    named = sorted(glob.glob(f"/dev/shm/{prefix}-*"))
    paths = list(named)
    worker = it.worker_pids[0]
    for pid in (os.getpid(), worker):
        paths += [f"/proc/{pid}/fd/{n}" for n in os.listdir(f"/proc/{pid}/fd")]
        paths += [f"/proc/{pid}/map_files/{n}" for n in os.listdir(f"/proc/{pid}/map_files")]
    for path in named:
        st = os.stat(path)
        assert st.st_mode & 0o777 == 0o600, f"{path}: mode {oct(st.st_mode & 0o777)}"
    results = _probe_as_nobody(paths)
    assert results.pop("uid") == 65534 and results.pop("euid") == 65534
    assert len(results) == len(paths)
    opened = {p: r for p, r in results.items() if any(x not in ("EACCES", "EPERM") for x in r)}
    assert not opened, f"another user got further than EACCES/EPERM: {opened}"
    for k, (x, y) in enumerate(held):
        assert torch.equal(y, torch.arange(4 * k, 4 * k + 4))
    del it, loader, held
