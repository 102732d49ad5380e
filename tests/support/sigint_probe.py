"""A process target that reports how it takes SIGINT (module level, so that a
forkserver or spawn child can import it)."""
import os
import signal
import time


def report_sigint(queue):
    """Put (the SIGINT handler's repr, what a SIGINT to this process did)."""
    handler = repr(signal.getsignal(signal.SIGINT))
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)
        outcome = "nothing"
    except KeyboardInterrupt:
        outcome = "KeyboardInterrupt"
    queue.put((handler, outcome))


def ignore_then_import_fastloader(queue):
    """A process that ignores SIGINT on purpose, then imports fastloader: put
    (the SIGINT handler's repr, what a SIGINT to this process did)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    import fastloader  # noqa: F401
    report_sigint(queue)
