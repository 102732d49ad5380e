"""A multiprocessing ForkServer that dies just as an epoch's workers start, each
from its own thread (fastloader starts them that way; torch one after the other).
The interleavings are forced by wrapping the server's ensure_running() and
multiprocessing's start of the next server. Imported by the scripts that
tests/test_forkserver.py and tests/test_spawn_server.py run in fresh
interpreters (a server lives as long as the process that started it)."""
import os
import signal
import threading
import time
from multiprocessing import util

RESTART_RACE = "dies while one start restarts it"
BOTH_REFUSED = "dies before both"


def _zombie(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _kill(pid):
    # dead and not yet reaped, so that the next ensure_running() finds it dead
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 60
    while not _zombie(pid) and time.monotonic() < deadline:
        time.sleep(0.01)


def make_it_die(server, how):
    """From now on the next two worker starts (not in the main thread) meet
    `server` dying. RESTART_RACE: the first start's check finds it running, then it
    is killed, and the second's finds it dead and starts the next; the first goes on
    only while that next server starts, its address not yet set (Python's
    connect_to_new_process() then read None). BOTH_REFUSED: both checks find it
    running, then it dies before either connects. Calls after those two (a start's
    second try) and from the main thread pass through. Returns a list that gets
    True if, in RESTART_RACE, the first start saw the restart begin."""
    first = server._forkserver_pid
    real_ensure, real_spawnv = server.ensure_running, util.spawnv_passfds
    calls, lock = [], threading.Lock()
    killed, restarting, raced = threading.Event(), threading.Event(), []
    both_checked = threading.Barrier(2)

    def ensure_running():
        if threading.current_thread() is threading.main_thread():
            return real_ensure()
        with lock:
            n = len(calls)
            calls.append(n)
        if n >= 2:
            return real_ensure()
        if how == BOTH_REFUSED:
            real_ensure()   # running, for both
            if both_checked.wait(60) == 0:
                _kill(first)
            both_checked.wait(60)   # dead before either connects
        elif n == 0:
            real_ensure()   # running
            _kill(first)
            killed.set()
            raced.append(restarting.wait(60))   # the other is starting the next
        else:
            killed.wait(60)
            real_ensure()   # finds it dead: starts the next

    def spawnv(*args, **kwargs):
        if threading.current_thread() is not threading.main_thread():
            restarting.set()
            time.sleep(1)   # while the next server's address is not yet set
        return real_spawnv(*args, **kwargs)

    server.ensure_running, util.spawnv_passfds = ensure_running, spawnv
    return raced
