"""Named segments whose owner is gone. Under sharing_strategy="file_system" every
segment name embeds the pid of the loader's main process and the identity of its
PID namespace; when a whole process group is SIGKILLed nobody is left to unlink
them, so the next loader (and `python -m fastloader doctor --clean`) removes them.
Only regular files owned by our effective uid whose owner process is gone are ever
removed: never another user's file, never a live loader's, never through a symlink.

A pid means something only inside its PID namespace, and containers sharing
/dev/shm (docker --ipc=host, several "hosts" on one machine) each have their own:
a segment whose name carries another namespace (or none we can read) is never
judged by our /proc, so it is never removed here."""
from __future__ import annotations

import functools
import os
import stat

# names and namespaces are sharing.py's; re-exported for the doctor and the tests
from .sharing import UNKNOWN_NAMESPACE, parse_segment_name, pid_namespace  # noqa: F401

SHM_DIR = "/dev/shm"

# The start time of a process is only known to the clock tick and boot time to the
# second; within this slack a segment is presumed to belong to the running process.
CLOCK_SLACK_S = 2.0






def segment_namespace_state(name: str) -> tuple[bool, str]:
    """(ours, why): whether the pid in a fastloader segment's name can be judged by our
    /proc. Names from another PID namespace, and names without one, cannot."""
    parsed = parse_segment_name(name)
    if parsed is None or parsed.namespace is None:
        return False, "other namespace, left alone (name carries no PID namespace)"
    here = pid_namespace()
    if here is None:
        return False, "other namespace, left alone (our PID namespace is unreadable)"
    if parsed.namespace != here:
        return False, f"other namespace, left alone (PID namespace {parsed.namespace})"
    return True, "our PID namespace"


# The kernel gives the initial PID namespace a fixed inode (PROC_PID_INIT_INO): only
# there does /proc list every process on the machine, those of every container too.
INITIAL_PID_NAMESPACE = f"{0xEFFFFFFC:08x}"


def torch_name_state(shm_is_private: bool = False) -> tuple[bool, str]:
    """(judged, why): whether the pid in a torch_<pid>_... name can be judged by our
    /proc. torch's names carry no PID namespace, so in a container another container
    sharing /dev/shm may have made one with a pid ours does not show (or shows as
    another process), and the in-use check cannot see its processes either. They are
    judged in the initial PID namespace, or where the user says that this /dev/shm is
    used by this PID namespace alone (docker's default: each container its own)."""
    if shm_is_private:
        return True, "this /dev/shm is this PID namespace's own (--shm-is-private)"
    if pid_namespace() == INITIAL_PID_NAMESPACE:
        return True, "the initial PID namespace"
    return False, ("torch's names carry no PID namespace and this process runs in a "
                   "PID namespace of its own (a container): another container sharing "
                   "/dev/shm may own it, left alone")




@functools.lru_cache(maxsize=None)
def _boot_time() -> float:
    with open("/proc/stat") as f:
        for line in f:
            if line.startswith("btime "):
                return float(line.split()[1])
    raise OSError("no btime in /proc/stat")


def process_start_time(pid: int) -> float | None:
    """Wall-clock start time of `pid`, or None when no live process has that pid (a
    zombie counts as gone: it can never touch a segment again)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    # The command name (field 2) may hold spaces and parentheses; the rest follows the last ')'.
    fields = data.rsplit(")", 1)[1].split()
    if fields[0] in ("Z", "X"):
        return None
    start_ticks = int(fields[19])   # field 22 of proc(5), counted from field 3 here
    return _boot_time() + start_ticks / os.sysconf("SC_CLK_TCK")


def owner_state(pid: int, mtime: float) -> tuple[bool, str]:
    """(alive, why): whether the process named in a segment's name still exists and is
    the one that wrote it (a pid reused by a later process started after the write)."""
    started = process_start_time(pid)
    if started is None:
        return False, f"process {pid} no longer exists"
    if started > mtime + CLOCK_SLACK_S:
        return False, f"pid {pid} now belongs to a process started after the segment was written"
    return True, f"process {pid} is running"


def sweep_dead_loaders(shm_dir: str = SHM_DIR) -> list:
    """Unlink the channel segments of loaders whose main process is gone; returns
    the names removed. Cheap (one directory listing), so every file_system loader
    runs it when it starts."""
    removed = []
    euid = os.geteuid()
    here = pid_namespace()
    if here is None or here == UNKNOWN_NAMESPACE:
        return removed   # no pid can be judged
    try:
        entries = os.scandir(shm_dir)
    except OSError:
        return removed
    with entries:
        for entry in entries:
            # only a loader's channel segments (see sharing.py for the names), and
            # only our PID namespace's: another namespace's pid means nothing here
            parsed = parse_segment_name(entry.name)
            if parsed is None or not parsed.channel or parsed.namespace != here:
                continue
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue   # removed meanwhile
            if not stat.S_ISREG(st.st_mode) or st.st_uid != euid:
                continue
            if owner_state(parsed.pid, st.st_mtime)[0]:
                continue
            # The sticky bit of /dev/shm keeps other users from replacing our file
            # between the check and the unlink.
            try:
                os.unlink(entry.path)
                removed.append(entry.name)
            except OSError:
                pass
    return removed
