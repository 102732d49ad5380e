"""Imported only as the last module a forkserver preloads when fastloader started
it with SIGINT blocked (Python's, forkserver.py, or spawn_server.py's own; see
sigint.py), so that a Ctrl-C cannot kill it half-way through importing torch.
The server keeps it blocked (its main() then ignores SIGINT anyway); every
process it forks unblocks it first thing, so that the program's own forkserver
processes take Ctrl-C as they would without fastloader. Nothing else imports it."""
import os

from .sigint import unblock_sigint

_SERVER = os.getpid()


def _in_the_servers_child():
    # at-fork hooks are inherited: a process forked by one of the server's children
    # keeps whatever mask its parent chose
    if os.getppid() == _SERVER:
        unblock_sigint()


os.register_at_fork(after_in_child=_in_the_servers_child)
