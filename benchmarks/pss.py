"""Peak PSS of a loader: the main process and every process it started, together.

PSS (proportional set size) charges each shared page to the processes that map
it in equal parts, so summing it over the main process and all workers counts
shared memory once: the fair figure for "what does this loader cost the
machine", whether it moves data through pipes, shared segments or threads.

Sampling runs in a small separate process (``python -m benchmarks.pss``, psutil
only, no torch): a thread in the main process would compete for the GIL with
the loader being measured. It reads /proc/<pid>/smaps_rollup of the tree every
``interval`` seconds between ``start()`` and ``stop()``, and ``stop()`` returns
the peak of the sum. Its own pid is left out of the sum and of the harness's
search for lingering workers.

PSS sees only pages that some process maps. A loader that passes a batch as a
shared-memory segment (torch's does: a segment per tensor, its fd in flight in a
queue) has batches that no process maps for a while: the worker has dropped its
mapping and the main process has not mapped it yet. Those pages are memory the
machine holds all the same. So each sample also reads the system's shared memory
(``Shmem`` in /proc/meminfo) against its value at ``start()``, and the part of
the growth that the tree's mappings did not grow by (its ``Pss_Shmem``) is added to
the tree's PSS: ``peak_with_unmapped_shm_bytes``, never less than the PSS peak, and
None on a kernel whose smaps_rollup lacks ``Pss_Shmem``. It assumes nothing else on
the machine changes its shared memory meanwhile (a quiet benchmark box).
"""

import json
import os
import subprocess
import sys
import threading
import time

import psutil

DEFAULT_INTERVAL_S = 0.1


class PssSampler:
    """Client: one sampler process for the whole benchmark, started and stopped per run."""

    def __init__(self, interval_s=DEFAULT_INTERVAL_S):
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.pss", str(os.getpid()), str(interval_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=root, env=env)
        self.pid = self.process.pid
        self._ask("ping")

    def _ask(self, command):
        self.process.stdin.write(command + "\n")
        self.process.stdin.flush()
        line = self.process.stdout.readline()
        if not line:
            raise RuntimeError(f"the PSS sampler (pid {self.pid}) exited")
        return json.loads(line)

    def start(self):
        self._ask("start")

    def stop(self):
        """{"peak_bytes": main + workers, "peak_main_bytes": main alone,
        "peak_with_unmapped_shm_bytes": main + workers + shared memory in flight,
        "samples": n}."""
        return self._ask("stop")

    def close(self):
        """Stop the sampler. Told to quit, not left to see the end of its stdin: the
        workers of a fork loader still alive (persistent workers) hold copies of
        that pipe's write end, so closing ours would not end it."""
        if self.process.poll() is None:
            try:
                self._ask("quit")
            except (OSError, RuntimeError, ValueError):
                pass   # gone already: reaped below
            self.process.stdin.close()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process.stdout.close()


def _rollup(pid):
    """{field: bytes} of /proc/<pid>/smaps_rollup (Pss, Pss_Shmem, ...)."""
    fields = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields


def _kernel_support():
    """(smaps_rollup exists, it has Pss_Shmem), asked of this process once."""
    try:
        return True, "Pss_Shmem" in _rollup("self")
    except OSError:
        return False, False


def _system_shmem():
    """Bytes of shared memory in the whole system (/proc/meminfo's Shmem)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def _tree_memory(root, own_pid, has_rollup):
    """(PSS of root + its descendants, PSS of root, their Pss_Shmem) in bytes;
    vanished processes skipped. Pss_Shmem is None where the tree could not be
    listed; without smaps_rollup (kernels before 4.14) PSS comes from psutil's walk
    of smaps and Pss_Shmem is 0."""
    total = main = shmem = 0
    try:
        processes = [root] + root.children(recursive=True)
    except psutil.Error:
        return 0, 0, None
    for process in processes:
        if process.pid == own_pid:
            continue
        try:
            if has_rollup:
                fields = _rollup(process.pid)
                pss, shmem_part = fields.get("Pss", 0), fields.get("Pss_Shmem", 0)
            else:
                pss, shmem_part = process.memory_full_info().pss, 0
        except (OSError, psutil.Error):
            continue  # a worker that exited between the listing and the read
        total += pss
        shmem += shmem_part
        if process.pid == root.pid:
            main = pss
    return total, main, shmem


class _Baseline:
    """The system's and the tree's shared memory when sampling started."""

    def __init__(self, system, tree):
        self.system = system
        self.tree = tree or 0

    def with_unmapped(self, total, tree_shmem):
        """The tree's PSS plus the shared memory that appeared since the start and
        that the tree does not map (what its Pss_Shmem did not grow by)."""
        if tree_shmem is None:
            return total
        unmapped = (_system_shmem() - self.system) - (tree_shmem - self.tree)
        return total + max(0, unmapped)


def _serve(root_pid, interval_s):
    root = psutil.Process(root_pid)
    own_pid = os.getpid()
    has_rollup, splits_shmem = _kernel_support()
    state = {"peak": 0, "peak_main": 0, "peak_all": 0, "samples": 0,
             "baseline": _Baseline(0, 0)}
    lock = threading.Lock()
    sampling = threading.Event()

    def sample():
        total, main, shmem = _tree_memory(root, own_pid, has_rollup)
        return total, main, state["baseline"].with_unmapped(total, shmem)

    def sample_loop():
        while True:
            sampling.wait()
            with lock:
                if sampling.is_set():
                    total, main, everything = sample()
                    state["peak"] = max(state["peak"], total)
                    state["peak_main"] = max(state["peak_main"], main)
                    state["peak_all"] = max(state["peak_all"], everything)
                    state["samples"] += 1
            time.sleep(interval_s)

    threading.Thread(target=sample_loop, daemon=True).start()
    for line in sys.stdin:
        command = line.strip()
        if command == "start":
            with lock:
                tree_shmem = _tree_memory(root, own_pid, has_rollup)[2]
                state.update(peak=0, peak_main=0, peak_all=0, samples=0,
                             baseline=_Baseline(_system_shmem(), tree_shmem))
            sampling.set()
            reply = {}
        elif command == "stop":
            sampling.clear()
            with lock:
                total, main, everything = sample()   # at least one sample, even for a short run
                peak = max(state["peak"], total)
                reply = {"peak_bytes": peak,
                         "peak_main_bytes": max(state["peak_main"], main),
                         # None: the kernel does not say how much of the PSS is
                         # shared memory, so what is not mapped cannot be told apart
                         "peak_with_unmapped_shm_bytes":
                             max(state["peak_all"], everything, peak) if splits_shmem else None,
                         "samples": state["samples"] + 1}
        elif command == "quit":
            print(json.dumps({}), flush=True)
            return
        else:
            reply = {}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    _serve(int(sys.argv[1]), float(sys.argv[2]))
