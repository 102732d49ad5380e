"""Suite-wide guards: no process and no /dev/shm/fastloader-* may outlive a test.

pytest settings (filterwarnings = error, faulthandler_timeout) live in pyproject.toml.
"""
import os
import sys

import psutil
import pytest

from tests.support import helpers, torch_features

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="session", autouse=True)
def _no_shm_left_behind_by_the_session():
    before = helpers.shm_names()
    yield
    helpers.settle()
    helpers.assert_no_shm_left(before)


def pytest_collection_modifyitems(items):
    # torch before 2.13 (seen on 2.1.2, 2.5.1 and 2.9.1, not on 2.13 and later):
    # when an error ends torch's own loader, its result queue's feeder thread may
    # raise as the queue is closed under it (EBADF, then "semaphore or lock
    # released too many times"). That is torch's thread, and pytest reports it at
    # the test's teardown.
    if torch_features.VERSION < (2, 13):
        mark = pytest.mark.filterwarnings("ignore:Exception in thread QueueFeederThread"
                                          ":pytest.PytestUnhandledThreadExceptionWarning")
        for item in items:
            item.add_marker(mark)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    report = yield
    setattr(item, "_report_" + report.when, report)
    return report


@pytest.fixture(autouse=True)
def _no_worker_outlives_its_test(request):
    """Every worker a test started must be joined (not merely killed: no zombie) once the
    test dropped its loaders."""
    before = helpers.loader_children()
    yield
    call = getattr(request.node, "_report_call", None)
    if call is None or call.failed:
        return  # a failed test's traceback still references its iterator: no extra noise

    def new_children():
        return helpers.loader_children() - before

    if new_children():  # cheap path first: a full gc per test adds up over the suite
        helpers.settle()
        # generous: a forked worker (most likely a reference torch loader's, told
        # to stop only when the gc frees its iterator) took over 5 s to exit under
        # `make test-asan` beside the CI suite on 2 CPUs; the wait ends once they are gone
        helpers.wait_until(lambda: not new_children(), 30)
    left = []
    for pid in sorted(new_children()):
        try:
            proc = psutil.Process(pid)
            left.append(f"{pid} ({proc.status()}): {' '.join(proc.cmdline())[:120]}")
        except psutil.Error:
            pass
    assert not left, "processes left running after the test:\n" + "\n".join(left)


@pytest.fixture
def subprocess_env():
    """Environment for a child interpreter that imports fastloader and tests like we do."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in sys.path if p])
    env.pop("PYTHONWARNINGS", None)
    return env
