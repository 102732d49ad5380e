"""Imported only as a preload of spawn_server.py's server (never elsewhere): makes
each process the server forks start as a fresh interpreter would in the one state
a fork would otherwise share. NumPy seeds its global random state from the OS
when it is first imported; a fork of the server would inherit the server's, and
every 'spawn' worker of every epoch would draw the same numbers (the classic fork
bug, which spawn does not have). Python's own `random` reseeds itself at fork."""
import os
import sys

_SERVER = os.getpid()


def _reseed_numpy_as_a_fresh_interpreter():
    if os.getppid() != _SERVER:
        return   # a process forked by one of the server's children keeps its parent's
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()   # no argument: fresh entropy from the OS


os.register_at_fork(after_in_child=_reseed_numpy_as_a_fresh_interpreter)
