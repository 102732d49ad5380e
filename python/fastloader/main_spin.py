"""Whether the main process may spin for its next batch before it sleeps.

A worker that publishes a batch while the main process sleeps for it must wake
it: a system call, and an interrupt to the CPU the main process slept on. On a
VM that interrupt is an exit to the host, which also leaves the worker's caches
and branch predictors colder: measured on a 2-vCPU KVM guest, one worker and the
main process on the other CPU, the wake-up cost the worker ~65 us of CPU per
batch (tokens: 333 us per batch against 268 when it never had to wake anyone;
the in-process loop takes 227). A main process that spins for the batch needs
no wake-up.

Spinning pays only with a CPU to spare: where the workers (of every loader this
process runs, and the other ranks' on this node) already use every CPU, the
spinning main process would take CPU from a worker. CUDA's default host
synchronisation follows the same rule (it spins while there are more CPUs than
active contexts), so a training process on a GPU box with idle cores looks the
same in `top` either way. The
spin also stops by itself while it rarely catches a batch (a slow dataset: see
csrc/spin.c), and `FASTLOADER_MAIN_SPIN=0` turns it off.
"""
from __future__ import annotations

import os

from .cgroup_cpus import cpu_quota
from .distributed import rank_and_world

# The longest one wait spins (then it sleeps as before). Long enough for a batch
# that takes a worker a few hundred microseconds (tokens: ~300 us per batch).
MAIN_SPIN_NS = 1_000_000


def _affinity(pid: int = 0) -> int | None:
    """How many CPUs process `pid` (0: this one) may run on; None if unknown."""
    try:
        return len(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return None


# What launchers call the number of ranks on this node.
_LOCAL_SIZE_VARIABLES = ("LOCAL_WORLD_SIZE",               # torchrun
                         "SLURM_NTASKS_PER_NODE",          # srun --ntasks-per-node
                         "OMPI_COMM_WORLD_LOCAL_SIZE",     # Open MPI
                         "MPI_LOCALNRANKS")                # MPICH, Intel MPI


# Set by launchers whose processes are their ranks' parents, for the ranks and not
# in their own environment: torchrun's agent, slurmstepd, Open MPI's and PMIx's
# daemons. (Lightning's own launcher makes rank 0 the parent of the others, and
# a plain run's parent is a shell: no rank can learn its launcher's CPUs from its
# parent there.)
_LAUNCHER_PARENT_VARIABLES = ("TORCHELASTIC_RUN_ID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_SIZE",
                              "PMIX_RANK")


def _parent_pid() -> int:
    return os.getppid()


# Our parent when this module was imported (or this process forked). A parent
# differs from it only by having taken us over when that one died: init, a
# container's init or a subreaper (systemd --user, tini -s), never the launcher.
_first_parent = os.getppid()


def _remember_parent() -> None:
    global _first_parent
    _first_parent = os.getppid()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_remember_parent)

# The inode of the first PID namespace (the kernel's PROC_PID_INIT_INO): where
# /proc/self/ns/pid has it, PID 1 is the machine's init, never a launcher.
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC


def _in_child_pid_namespace() -> bool:
    """Whether this process runs in a PID namespace of its own (a container),
    where PID 1 may be the launcher (torchrun as the entrypoint). False where it
    cannot be told."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino != _INITIAL_PID_NAMESPACE
    except OSError:
        return False


def _proc_is_ours() -> bool:
    """Whether /proc numbers processes as getppid() does: under `unshare --pid`
    without a /proc of its own, /proc/<ppid> is another namespace's process (its
    /proc/1 the machine's init)."""
    try:
        return os.readlink("/proc/self") == str(os.getpid())
    except OSError:
        return False


def _launcher_may_be(parent: int) -> bool:
    """Whether process `parent`, our parent, may be a launcher at all: the parent
    we started under (not one that took us over), inside our PID namespace
    (getppid() 0 is outside it), readable through our /proc, and PID 1 only where
    that is a container's first process."""
    if parent <= 0 or parent != _first_parent or not _proc_is_ours():
        return False
    return parent != 1 or _in_child_pid_namespace()


def _environ_names(pid: int) -> set | None:
    """The names in process `pid`'s environment: none where it is another user's
    (slurmstepd runs as root), which no shell of ours is; None where it is gone
    or unreadable otherwise."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            entries = f.read().split(b"\0")
    except PermissionError:
        return set()
    except OSError:
        return None
    return {entry.split(b"=", 1)[0].decode("utf-8", "surrogateescape")
            for entry in entries if entry}


def _launchers_cpus(own: float) -> float:
    """The CPUs this node's ranks share: their launcher's (our parent's) where a
    launcher that is every rank's parent started us, else our own. A launcher's
    variable in our environment proves little by itself (a shell inside
    ``srun --pty bash`` passes SLURM_STEP_ID on): the parent must lack one of them
    (torchrun started by srun carries SLURM_STEP_ID, not TORCHELASTIC_RUN_ID)."""
    names = [name for name in _LAUNCHER_PARENT_VARIABLES if name in os.environ]
    parent = _parent_pid()
    if not names or not _launcher_may_be(parent):
        return own
    parents_names = _environ_names(parent)
    if parents_names is None or all(name in parents_names for name in names):
        return own
    launcher = _affinity(parent)
    return own if launcher is None else launcher


def ranks_on_this_node() -> int:
    """Processes like this one on the node, each with its own loader. Where the
    launcher names no local size (Lightning's own sets only WORLD_SIZE and
    LOCAL_RANK), every rank of the job may be here: counting them all can only
    turn the spin off."""
    for name in _LOCAL_SIZE_VARIABLES:
        try:
            return max(1, int(os.environ[name]))
        except (KeyError, ValueError):
            continue
    return max(1, rank_and_world()[1])


def _cpu_room() -> float:
    """This rank's share of the CPUs: the CPUs the node's ranks share (see
    _launchers_cpus) over the ranks, at most this process's own (a launcher that
    binds each rank to CPUs of its own, srun --cpu-bind, has narrowed them to its
    share already). A CFS quota below the shared CPUs, once used up, stops every
    thread of the group (the workers too) until its period ends, so one CPU of it
    is left for the processes' other threads: (quota - 1) over the ranks."""
    ranks = ranks_on_this_node()
    own = _affinity() or os.cpu_count() or 1
    shared = _launchers_cpus(own)
    room = min(own, shared / ranks)
    quota = cpu_quota()
    if quota is not None and quota < shared:
        room = min(room, (quota - 1) / ranks)
    return room


class MainSpin:
    """One iterator's rule: spin while the workers of every live loader of this
    process, this thread and (with pin_memory) the pin thread fit in this rank's
    CPUs. Decided once, checked per batch against the live workers."""

    __slots__ = ("_room",)

    def __init__(self, pin_memory: bool = False):
        room = None
        if os.environ.get("FASTLOADER_MAIN_SPIN", "1").strip() != "0":
            try:
                room = _cpu_room() - 1 - (1 if pin_memory else 0)
            except Exception:   # an odd /proc or environment: never spin
                room = None
        self._room = room

    def ns(self, live_workers: int) -> int:
        """recv()'s spin_ns, with `live_workers` running in this process."""
        room = self._room
        return MAIN_SPIN_NS if room is not None and live_workers <= room else 0


def main_spin_ns(num_workers: int, pin_memory: bool = False) -> int:
    """The spin for a process whose only loader has `num_workers` workers."""
    return MainSpin(pin_memory).ns(num_workers)
