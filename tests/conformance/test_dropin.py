"""Drop-in details that code written for torch's DataLoader relies on (issue 13):
DataLoader[...] in annotations, iter(loader)._workers, fastloader.install() for the
loaders frameworks build, and the copy-on-read warning for pandas / NumPy objects."""
import gc
import json
import linecache
import multiprocessing.process
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import threading
import traceback
import typing
import warnings

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader
from torch.utils.data.dataloader import _SingleProcessDataLoaderIter

import fastloader
from fastloader import DataLoader, FastLoaderWarning, WorkerError, torch_sites
from fastloader.iterator import FastMultiProcessingIter
from fastloader.worker_process import WorkerProcess
from fastloader.metadata_warning import (HeavyMetadataWarning, _reset_once_registry,
                                         find_heavy_metadata)
from tests.support import dropin_datasets as dd
from tests.support.helpers import assert_same_batch_lists, collect, deadline
from tests.support import torch_features as tf

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

MIB = 1 << 20
TORCH_GET_ITERATOR = TorchDataLoader.__dict__["_get_iterator"]


@pytest.fixture(autouse=True)
def _never_leave_installed():
    yield
    fastloader.uninstall()
    assert TorchDataLoader.__dict__["_get_iterator"] is TORCH_GET_ITERATOR


def seeded(cls, dataset, **kw):
    return cls(dataset, batch_size=4, shuffle=True, num_workers=2,
               generator=torch.Generator().manual_seed(7), **kw)


# ---- 1. DataLoader[T] ------------------------------------------------------------------

def test_subscripting_works_in_annotations_evaluated_at_import(tmp_path):
    source = textwrap.dedent("""
        from typing import Dict, List
        import torch
        from fastloader import DataLoader

        def make(ds) -> DataLoader[List[torch.Tensor]]:
            return DataLoader(ds, batch_size=2)

        LOADERS: Dict[str, DataLoader[Dict[str, torch.Tensor]]] = {}

        class Holder:
            loader: DataLoader[int]
        """)
    namespace = {}
    exec(compile(source, "annotated_module.py", "exec"), namespace)   # no __future__
    hints = typing.get_type_hints(namespace["make"])
    assert typing.get_origin(hints["return"]) is DataLoader
    assert typing.get_args(hints["return"]) == (typing.List[torch.Tensor],)
    assert DataLoader.__parameters__ and len(DataLoader.__parameters__) == 1


def test_subscripted_class_builds_a_loader_that_behaves_as_torch():
    loader = DataLoader[int](list(range(10)), batch_size=3)
    assert type(loader) is DataLoader
    assert isinstance(loader, TorchDataLoader) and issubclass(DataLoader, TorchDataLoader)
    assert_same_batch_lists(list(TorchDataLoader(list(range(10)), batch_size=3)), list(loader))
    # pickling and the framework rebuild pattern (type(loader)(**kwargs)) still work
    again = pickle.loads(pickle.dumps(loader))
    assert type(again) is DataLoader and again.batch_size == 3
    rebuilt = type(loader)(loader.dataset, batch_size=5, sharing_strategy="file_system")
    assert rebuilt.sharing_strategy == "file_system" and len(list(rebuilt)) == 2

    class Sub(DataLoader[typing.Dict[str, torch.Tensor]]):
        pass

    assert issubclass(Sub, DataLoader) and Sub.__orig_bases__[0].__origin__ is DataLoader
    assert len(list(Sub(list(range(4)), batch_size=2))) == 2


# Two user files, checked in one mypy run (each run costs ~10 s from cold).
TYPED_USER = """
    from typing import List
    import torch
    from fastloader import DataLoader

    def make(ds: torch.utils.data.Dataset[int]) -> DataLoader[List[torch.Tensor]]:
        return DataLoader(ds, batch_size=2)

    loader: torch.utils.data.DataLoader[List[torch.Tensor]] = make(None)  # type: ignore[arg-type]
    reveal_type(make)
    """
PUBLIC_API = """
    from typing import Any, Dict, List, Optional
    import torch
    import fastloader
    from fastloader import (DataLoader, FastLoaderError, PackedArray, PackedStringArray,
                            WorkerError, install, installed, uninstall)

    names = PackedStringArray(["a", "b"], sharing_strategy="file_system")
    first: str = names[0]
    records = PackedArray([{"k": 1}])
    loader: DataLoader[List[torch.Tensor]] = DataLoader(
        [torch.ones(2)] * 4, batch_size=2, num_workers=0,
        sharing_strategy="file_descriptor", snapshot_every_n_steps=0)
    state: Dict[str, Any] = loader.state_dict()
    loader.load_state_dict(state)
    stats: Optional[Dict[str, Any]] = loader.stats()
    install("file_system")
    on: bool = installed()
    uninstall()
    assert issubclass(WorkerError, FastLoaderError) and issubclass(WorkerError, RuntimeError)
    version: str = fastloader.__version__
    DataLoader([1], sharing_strategy=1)   # the one error expected below
    """


def test_mypy_accepts_the_annotations_and_checks_the_public_api(tmp_path):
    """DataLoader[...] annotations type-check and keep their parameter; the public API
    type-checks as documented, and mypy sees through it: a wrong argument type is
    reported (so that the checks are not vacuous)."""
    pytest.importorskip("mypy")
    typed_user, public_api = tmp_path / "typed_user.py", tmp_path / "public_api.py"
    typed_user.write_text(textwrap.dedent(TYPED_USER))
    public_api.write_text(textwrap.dedent(PUBLIC_API))
    env = dict(os.environ, MYPYPATH=os.path.dirname(os.path.dirname(fastloader.__file__)))
    out = subprocess.run([sys.executable, "-m", "mypy", "--no-incremental",
                          "--follow-imports=silent", "--ignore-missing-imports",
                          "--cache-dir", str(tmp_path / "cache"), str(typed_user),
                          str(public_api)],
                         capture_output=True, text=True, env=env, timeout=600)
    report = out.stdout + out.stderr
    errors = [line for line in out.stdout.splitlines() if ": error:" in line]
    assert not [e for e in errors if "typed_user.py:" in e], report
    assert "fastloader.dataloader.DataLoader[list[torch._tensor.Tensor]]" in out.stdout, report
    assert len(errors) == 1, report
    bad_line = 1 + next(i for i, line in enumerate(public_api.read_text().splitlines())
                        if "sharing_strategy=1" in line)
    assert f"public_api.py:{bad_line}:" in errors[0] and '"sharing_strategy"' in errors[0], \
        errors


# ---- 2. iter(loader)._workers -----------------------------------------------------------

def _workers_running(it, n):
    workers = it._workers
    assert len(workers) == n and it._worker_pids_set
    me = os.getpid()
    for w in workers:
        assert isinstance(w.pid, int) and psutil.Process(w.pid).ppid() == me
        assert w.is_alive() and w.exitcode is None and w.daemon is True
        assert isinstance(w.name, str) and w.name
        assert isinstance(w, multiprocessing.process.BaseProcess)
    return workers


@pytest.mark.parametrize("cls", [TorchDataLoader, DataLoader], ids=["torch", "fastloader"])
def test_workers_are_readable_during_and_after_the_epoch_as_with_torch(cls):
    with deadline(60):
        it = iter(seeded(cls, dd.WhoLoads()))
        first = next(it)
        workers = _workers_running(it, 2)
        served = {int(p) for p in first["pid"]}
        for batch in it:
            served |= {int(p) for p in batch["pid"]}
        assert served == {w.pid for w in workers}   # the very processes that loaded
        for w in workers:
            w.join(30)
            assert not w.is_alive() and w.exitcode == 0
        assert not it._worker_pids_set and it._workers == workers


def test_worker_process_is_a_base_process_that_cannot_restart():
    with deadline(60):
        it = iter(seeded(DataLoader, dd.WhoLoads()))
        next(it)
        w = it._workers[0]
        assert isinstance(w, multiprocessing.process.BaseProcess) and type(w) is WorkerProcess
        assert isinstance(w.authkey, bytes) and w.ident == w.pid
        assert "WorkerProcess" in repr(w)
        with pytest.raises(AssertionError, match="twice"):
            w.start()
        for _ in it:
            pass
        w.join(30)
        assert w.exitcode == 0 and not w.is_alive()


def test_a_worker_killed_through_its_pid_shows_its_exitcode():
    with deadline(60):
        it = iter(seeded(DataLoader, dd.WhoLoads(400)))
        next(it)
        victim, other = _workers_running(it, 2)
        os.kill(victim.pid, signal.SIGKILL)
        victim.join(30)
        assert victim.exitcode == -signal.SIGKILL and not victim.is_alive()
        with pytest.raises(WorkerError, match=f"pid {victim.pid}"):
            for _ in it:
                pass
        # the pool closed the process objects; they still answer as torch's do
        assert victim.exitcode == -signal.SIGKILL and victim.pid is not None
        other.join(30)
        assert other.exitcode is not None and not other.is_alive()
        victim.terminate()   # reaped: must not signal a pid that may be reused
        victim.kill()


def test_terminate_through_workers_ends_the_epoch_with_a_clear_error():
    with deadline(60):
        it = iter(seeded(DataLoader, dd.WhoLoads(400), persistent_workers=True))
        next(it)
        w = it._workers[1]
        w.terminate()
        w.join(30)
        assert w.exitcode == -signal.SIGTERM
        with pytest.raises(WorkerError, match="SIGTERM"):
            for _ in it:
                pass


# ---- 5. install() -----------------------------------------------------------------------

def _what(batches):
    return [{k: v for k, v in b.items() if k not in ("pid", "fast")} for b in batches]


def _epoch(loader):
    with deadline(60):
        return collect(loader)


def test_install_gives_torch_loaders_fastloader_workers_and_the_same_batches():
    expected = _epoch(seeded(TorchDataLoader, dd.WhoLoads()))
    assert not any(bool(b["fast"].any()) for b in expected)   # torch's own workers
    fastloader.install()
    fastloader.install()   # idempotent
    assert fastloader.installed()
    for cls in (TorchDataLoader, dd.IterOverridingLoader):
        loader = seeded(cls, dd.WhoLoads())
        got = _epoch(loader)
        assert type(loader) is cls
        assert all(bool(b["fast"].all()) for b in got)
        # who loaded differs; what was loaded must not
        assert_same_batch_lists(_what(expected), _what(got))
    probe = TorchDataLoader(dd.WhoLoads(), batch_size=4, num_workers=1)
    assert type(iter(probe)) is FastMultiProcessingIter
    # num_workers=0 stays torch's path; a subclass with its own iterator keeps it
    assert type(iter(TorchDataLoader(list(range(4))))) is _SingleProcessDataLoaderIter
    own = seeded(dd.OwnIteratorLoader, dd.WhoLoads())
    got = _epoch(own)
    assert not any(bool(b["fast"].any()) for b in got)
    fastloader.uninstall()
    fastloader.uninstall()   # idempotent
    assert not fastloader.installed()
    assert TorchDataLoader.__dict__["_get_iterator"] is TORCH_GET_ITERATOR
    got = _epoch(seeded(TorchDataLoader, dd.WhoLoads()))
    assert not any(bool(b["fast"].any()) for b in got)


def test_install_keeps_persistent_workers_and_strategy():
    fastloader.install(sharing_strategy="file_system")
    loader = seeded(TorchDataLoader, dd.WhoLoads(), persistent_workers=True)
    first, second = _epoch(loader), _epoch(loader)
    assert loader._iterator.sharing_strategy == "file_system"
    assert all(bool(b["fast"].all()) for b in first + second)
    pids = {int(p) for b in first + second for p in b["pid"]}
    assert len(pids) == 2   # the same two workers served both epochs
    loader._iterator._shutdown_workers()
    with pytest.raises(ValueError, match="sharing_strategy"):
        fastloader.install(sharing_strategy="shared")


def test_install_and_uninstall_from_many_threads_leave_torch_consistent():
    barrier = threading.Barrier(8)

    def flip(i):
        barrier.wait()
        for _ in range(200):
            (fastloader.install if i % 2 else fastloader.uninstall)()

    threads = [threading.Thread(target=flip, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    current = TorchDataLoader.__dict__["_get_iterator"]
    assert (current is not TORCH_GET_ITERATOR) == fastloader.installed()
    fastloader.uninstall()
    assert TorchDataLoader.__dict__["_get_iterator"] is TORCH_GET_ITERATOR


def test_uninstall_leaves_a_later_patch_alone():
    fastloader.install()

    def someone_elses(self):
        return TORCH_GET_ITERATOR(self)

    TorchDataLoader._get_iterator = someone_elses
    try:
        with pytest.warns(FastLoaderWarning, match="replaced by someone else"):
            fastloader.uninstall()
        assert TorchDataLoader.__dict__["_get_iterator"] is someone_elses
    finally:
        TorchDataLoader._get_iterator = TORCH_GET_ITERATOR


@pytest.mark.parametrize("value,strategy", [("1", "file_descriptor"),
                                            ("file_system", "file_system"), ("0", None),
                                            ("false", None), ("No", None), ("OFF", None),
                                            ("", None), ("TRUE", "file_descriptor")])
def test_environment_variable_installs_at_import(subprocess_env, value, strategy):
    code = textwrap.dedent("""
        import torch, fastloader
        from tests.support.dropin_datasets import WhoLoads
        loader = torch.utils.data.DataLoader(WhoLoads(8), batch_size=4, num_workers=1)
        it = iter(loader)
        batch = next(it)
        print(fastloader.installed(), type(it).__name__, bool(batch["fast"].all()),
              getattr(it, "sharing_strategy", None))
        """)
    env = dict(subprocess_env, FASTLOADER_INSTALL=value)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "is not one of" not in out.stderr, out.stderr
    if strategy is None:
        assert out.stdout.split() == ["False", "_MultiProcessingDataLoaderIter", "False", "None"]
    else:
        assert out.stdout.split() == ["True", "FastMultiProcessingIter", "True", strategy]


def test_unknown_environment_value_installs_and_warns(subprocess_env):
    env = dict(subprocess_env, FASTLOADER_INSTALL="maybe", PYTHONWARNINGS="default")
    out = subprocess.run([sys.executable, "-c", "import fastloader; print(fastloader.installed())"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True"]
    assert "FASTLOADER_INSTALL='maybe' is not one of" in out.stderr, out.stderr


@pytest.mark.parametrize("as_module", [False, True], ids=["script", "module"])
def test_launch_runs_an_unmodified_script_with_install(subprocess_env, tmp_path, as_module):
    (tmp_path / "train_unmodified.py").write_text(textwrap.dedent("""
        import sys
        import torch
        from tests.support.dropin_datasets import WhoLoads

        if __name__ == "__main__":
            loader = torch.utils.data.DataLoader(WhoLoads(8), batch_size=4, num_workers=1)
            it = iter(loader)
            print(type(it).__name__, bool(next(it)["fast"].all()), sys.argv[1:])
        """))
    target = ["-m", "train_unmodified"] if as_module else [str(tmp_path / "train_unmodified.py")]
    env = dict(subprocess_env, PYTHONPATH=f"{tmp_path}{os.pathsep}{subprocess_env['PYTHONPATH']}")
    out = subprocess.run([sys.executable, "-m", "fastloader.launch", *target, "--lr", "0.1"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["FastMultiProcessingIter", "True", "['--lr',", "'0.1']"]
    usage = subprocess.run([sys.executable, "-m", "fastloader.launch"], capture_output=True,
                           text=True, env=env, timeout=300)
    assert usage.returncode == 2 and "usage" in usage.stderr


def test_reading_accelerates_prepared_flag_warns_unless_installed():
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=2)
    with pytest.warns(FastLoaderWarning, match="accelerate.*fastloader.install"):
        assert getattr(loader, "_is_accelerate_prepared", False) is False
    fastloader.install()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert getattr(loader, "_is_accelerate_prepared", False) is False
    fs = DataLoader(list(range(8)), batch_size=2, num_workers=2, sharing_strategy="file_system")
    with pytest.warns(FastLoaderWarning, match="install\\(sharing_strategy='file_system'\\)"):
        getattr(fs, "_is_accelerate_prepared", False)
    loader._is_accelerate_prepared = True   # accelerate sets it on what it returns
    assert loader._is_accelerate_prepared is True
    fastloader.uninstall()
    with warnings.catch_warnings():   # nothing left to say about a prepared loader
        warnings.simplefilter("error")
        assert loader._is_accelerate_prepared is True
        assert getattr(DataLoader([1], num_workers=0), "_is_accelerate_prepared", 0) is False


# ---- 7. pandas and NumPy object metadata ------------------------------------------------

N_ROWS = 1_000_000


@pytest.fixture(scope="module")
def paths_frame():
    pd = pytest.importorskip("pandas")
    paths = [f"images/train/{i:07d}.jpg" for i in range(N_ROWS)]
    return pd.DataFrame({"path": pd.Series(paths, dtype=object),
                         "label": np.arange(N_ROWS) % 1000})


def test_warns_for_an_object_column_of_a_dataframe(paths_frame):
    _reset_once_registry()
    loader = DataLoader(dd.PathsFrame(paths_frame), batch_size=4096, num_workers=2,
                        collate_fn=dd.sum_collate)
    with pytest.warns(HeavyMetadataWarning) as caught:
        it = iter(loader)
    text = str(caught[0].message)
    assert "`dataset.df['path']`" in text and "pandas column" in text
    assert "1,000,000 items" in text and "per worker" in text
    assert "fastloader.PackedStringArray(df['path'])" in text
    it._shutdown_workers()
    # the numeric column is not named; nor is anything once the column is packed
    assert [f.path for f in find_heavy_metadata(dd.PathsFrame(paths_frame))] == \
        ["dataset.df['path']"]


def test_series_numpy_object_arrays_and_python_strings_are_found(paths_frame):
    pd = pytest.importorskip("pandas")
    column = paths_frame["path"]

    class Holder:
        def __init__(self):
            self.series = column
            self.objects = column.to_numpy()
            self.python_strings = pd.Series(column, dtype=pd.StringDtype("python"))
            self.labels = paths_frame["label"]                  # int64: no objects
            self.packed = fastloader.PackedStringArray(column)  # the documented fix

    found = {f.path: f for f in find_heavy_metadata(Holder())}
    assert set(found) == {"dataset.series", "dataset.objects", "dataset.python_strings"}
    assert all(f.all_str and f.items == N_ROWS for f in found.values())
    assert list(Holder().packed[:2]) == list(column[:2])


def test_frames_in_dict_or_list_attributes_and_object_indexes_are_found(paths_frame):
    pd = pytest.importorskip("pandas")
    names = paths_frame["path"].tolist()

    class Splits:
        def __init__(self):
            self.splits = {"train": paths_frame, "val": paths_frame.iloc[:10]}
            self.frames = [paths_frame[["label"]], paths_frame[["path"]]]
            self.lists = {"names": names}
            self.index = pd.Index(names, dtype=object)
            self.by_name = paths_frame.set_index("path")     # indexed by file name
            self.numbers = pd.Index(np.arange(N_ROWS))       # int64: no objects

    found = {f.path: f for f in find_heavy_metadata(Splits())}
    assert set(found) == {"dataset.splits['train']['path']", "dataset.frames[1]['path']",
                          "dataset.lists['names']", "dataset.index",
                          "dataset.by_name.index"}, sorted(found)
    assert all(f.all_str and f.items == N_ROWS for f in found.values())
    assert found["dataset.index"].type_name == "pandas Index of Python objects"


def test_arrow_backed_strings_are_not_reported():
    pd = pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    frame = pd.DataFrame({"path": pd.Series([f"p/{i}" for i in range(200_000)],
                                            dtype=pd.StringDtype("pyarrow"))})
    assert find_heavy_metadata(dd.PathsFrame(frame)) == []


@pytest.mark.skipif(bool(os.environ.get("FASTLOADER_ASAN")),
                    reason="USS figures do not hold under AddressSanitizer")
def test_the_estimate_matches_the_measured_per_worker_cost_and_the_fix_removes_it(
        subprocess_env):
    # measured in a fresh interpreter: see tests/support/cow_epoch.py for why
    pytest.importorskip("pandas")
    out = subprocess.run([sys.executable, "-m", "tests.support.cow_epoch", str(N_ROWS)],
                         env=subprocess_env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    m = json.loads(out.stdout)
    assert m["objects_total"] == m["packed_total"] == m["expected_total"]  # every row read
    estimate, growth, growth_packed = m["estimate"], m["objects"], m["packed"]
    # the warning's figure is the copy a forked worker really makes, within 2x
    assert estimate / 2 <= growth <= estimate * 2, \
        f"estimate {estimate / MIB:.1f} MiB, measured {growth / MIB:.1f} MiB"
    # packed: no per-row object to copy (what remains is the worker's own churn)
    assert growth_packed < min(growth, estimate) / 4, \
        f"packed: {growth_packed / MIB:.1f} MiB, objects: {growth / MIB:.1f} MiB"


@pytest.mark.parametrize("ctx", ["spawn", "forkserver"])
@pytest.mark.parametrize("install", [False, True], ids=["DataLoader", "install"])
def test_unpicklable_worker_arguments_warn_from_torchs_module_as_torchs(ctx, install):
    """A collate_fn that does not pickle (a lambda) where workers are started by
    pickling: torch warns with its hint, from its own dataloader module, then raises
    the pickling error. fastloader's warning is torch's (category, text, file), so a
    filter on torch's module silences both, and the error is the same type."""
    def attempt(make, module_filter):
        loader = make(list(range(4)), batch_size=2, num_workers=1, multiprocessing_context=ctx,
                      collate_fn=lambda b: b)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if module_filter:
                warnings.filterwarnings("ignore", module=r"torch\.utils\.data\.dataloader")
            with pytest.raises(Exception) as info, deadline(60):
                next(iter(loader))
        hints = [(w.category, str(w.message), w.filename) for w in caught
                 if "pickle error" in str(w.message)]
        return type(info.value), hints

    expected = [attempt(TorchDataLoader, f) for f in (False, True)]
    # what torch does: its hint where its code has one (2.13 does; 2.5 and older do
    # not), which a filter on its module silences
    assert bool(expected[0][1]) == (torch_sites.pickle_hint is not None), expected
    assert not expected[1][1], expected
    if install:
        fastloader.install()
        try:
            got = [attempt(TorchDataLoader, f) for f in (False, True)]
        finally:
            fastloader.uninstall()
    else:
        got = [attempt(DataLoader, f) for f in (False, True)]
    assert got == expected


_TORCHS_WARNINGS_SCRIPT = """
import os, sys, warnings
import torch
from torch.utils.data import DataLoader as TorchDataLoader
import fastloader

how = sys.argv[1]
if how == "install":
    fastloader.install()
make = fastloader.DataLoader if how == "DataLoader" else TorchDataLoader
# more workers than usable CPUs (torch's worker-count warning, at construction and
# at iter()) and pin_memory without an accelerator (its pin_memory warning)
loader = make(list(range(8)), batch_size=2, num_workers=len(os.sched_getaffinity(0)) + 1,
              pin_memory=True, multiprocessing_context="fork")
loader.num_workers = 1   # the iter() warning also after a change, as torch checks again
loader.num_workers = len(os.sched_getaffinity(0)) + 1
for _ in range(2):
    assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
print("clean")
"""


@pytest.mark.parametrize("how", ["torch", "DataLoader", "install"])
def test_torchs_own_warnings_obey_a_filter_on_torchs_module(how, tmp_path):
    """torch's worker-count and pin_memory warnings count as warnings of its module
    torch.utils.data.dataloader, and point at its lines: a project that runs with
    every warning an error except that module's (python -W, pytest's
    filterwarnings) runs as cleanly with fastloader. fastloader makes those calls
    itself, and its warnings used to point into fastloader: they were errors."""
    script = tmp_path / "loop.py"
    script.write_text(_TORCHS_WARNINGS_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    run = subprocess.run(
        [sys.executable, "-W", "error", "-W", "ignore::UserWarning:torch.utils.data.dataloader",
         str(script), how], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0 and run.stdout.strip() == "clean", run.stderr[-3000:]


def test_every_torch_site_is_at_torchs_own_call():
    """fastloader.torch_sites found each call in torch's code (not a fallback line):
    the source line of torch's file where each site sits makes that call. A torch
    that moves one fails here first."""
    from fastloader import torch_sites
    calls = {torch_sites.check_worker_number: "self.check_worker_number_rationality()",
             torch_sites.new_multiprocessing_iter: "_MultiProcessingDataLoaderIter(self)",
             torch_sites.base_iter_init: "super().__init__(loader)"}
    for site, call in calls.items():
        code = site.__code__
        assert code.co_filename == torch.utils.data.dataloader.__file__
        assert site.__globals__ is vars(torch.utils.data.dataloader)
        lines = {line for _, _, line in code.co_lines() if line is not None}
        assert any(call in linecache.getline(code.co_filename, line) for line in lines), (
            site, lines)


class _RaisingBatchSampler:
    def __len__(self):
        return 1

    def __iter__(self):
        raise ValueError("no batches")


@pytest.mark.parametrize("how", ["DataLoader", "install"])
def test_a_traceback_through_torchs_lines_reads_as_torchs(how):
    """An error raised while iter() builds the iterator: the frames of the
    traceback in torch's dataloader.py (file, line, function, source line, carets)
    are the ones torch's own DataLoader shows; fastloader's own frames come between
    them."""
    def torch_frames(make):
        loader = make(list(range(4)), batch_sampler=_RaisingBatchSampler(), num_workers=1,
                      multiprocessing_context="fork")
        with pytest.raises(ValueError, match="no batches") as info:
            iter(loader)
        chunks = traceback.format_exception(info.value)
        return [c for c in chunks if c.startswith(f'  File "{torch.utils.data.dataloader.__file__}"')]

    # torch's iterator's __del__ fails after its __init__ raised (its own known
    # defect); only that is let through, and only in torch's run
    ignored, hook = [], sys.unraisablehook
    sys.unraisablehook = ignored.append
    try:
        expected = torch_frames(TorchDataLoader)
        gc.collect()
    finally:
        sys.unraisablehook = hook
    assert all(type(u.exc_value) is AttributeError and "_shutdown" in str(u.exc_value)
               for u in ignored), ignored
    assert len(expected) >= 3, expected
    if how == "install":
        fastloader.install()
        try:
            got = torch_frames(TorchDataLoader)
        finally:
            fastloader.uninstall()
    else:
        got = torch_frames(DataLoader)
    assert got == expected


class _LongerThanItsLen(torch.utils.data.IterableDataset):
    """Yields 4 samples, says 2: torch warns once more than len() have been fetched."""

    def __iter__(self):
        return iter(range(4))

    def __len__(self):
        return 2


@pytest.mark.parametrize("asked", ["before the first epoch", "between epochs"])
@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent"])
def test_the_iterable_length_warning_points_at_the_users_loop_as_torchs(asked, persistent):
    """torch's warning that an IterableDataset yielded more than its len() points
    at the loop that iterates the loader (stacklevel=2 from torch's __next__), so
    the user sees their line; fastloader's must point at the same line, also when
    len() is first asked between two epochs of persistent workers."""
    dataset = _LongerThanItsLen()   # one object: the message holds its repr

    def warned(make):
        loader = make(dataset, batch_size=None, num_workers=1, persistent_workers=persistent,
                      multiprocessing_context="fork")
        if asked == "between epochs":
            with warnings.catch_warnings():
                warnings.simplefilter("error")   # no len() asked yet: no warning
                assert list(loader) == [0, 1, 2, 3]
        len(loader)
        with warnings.catch_warnings(record=True) as caught, deadline(60):
            warnings.simplefilter("always")
            for _ in loader:   # the line both warnings must point at
                pass
        return [(w.category, str(w.message), w.filename, w.lineno) for w in caught
                if "Length of IterableDataset" in str(w.message)]

    expected = warned(TorchDataLoader)
    assert expected, expected
    if tf.ITERABLE_LENGTH_WARNING_AT_CALLER:   # 2.9 and older: from their own line
        assert {w[2] for w in expected} == {__file__}, expected   # torch's: this loop
    assert warned(DataLoader) == expected


# -- warnings shown once per location stay shown once ----------------------------
_ONCE_PER_LOCATION = textwrap.dedent("""
    import sys, warnings, torch
    from torch.utils.data import TensorDataset
    if sys.argv[1] == "fastloader":
        from fastloader import DataLoader
    else:
        from torch.utils.data import DataLoader
    def user_code():
        warnings.warn("a warning shown once per location", UserWarning)
    loader = DataLoader(TensorDataset(torch.arange(8)), batch_size=4, num_workers=2,
                        multiprocessing_context="fork")
    for epoch in range(4):
        for batch in loader:
            user_code()
    """)


def test_a_warning_shown_once_per_location_is_not_shown_again_each_epoch(subprocess_env):
    """The default action shows a warning once per location. fastloader entered
    warnings.catch_warnings() around each fork while the previous epoch's workers
    were being reaped, which resets every module's record of what it showed: from
    the second epoch on the user's (and libraries') warnings came back once per epoch."""
    counts = {}
    for name in ("torch", "fastloader"):
        out = subprocess.run([sys.executable, "-c", _ONCE_PER_LOCATION, name],
                             capture_output=True, text=True, env=subprocess_env, timeout=300)
        assert out.returncode == 0, out.stderr
        counts[name] = out.stderr.count("a warning shown once per location")
    assert counts == {"torch": 1, "fastloader": 1}


@pytest.mark.parametrize("setup, shown", [
    (lambda: None, False),                                          # the default filters
    # CPython drops it where it would be an error (-W error, pytest's -W error)
    (lambda: warnings.simplefilter("error"), False),
    (lambda: warnings.simplefilter("default"), True),
    (lambda: (warnings.simplefilter("error"),
              warnings.filterwarnings("ignore", category=DeprecationWarning)), False),
    (lambda: (warnings.simplefilter("ignore"),
              warnings.filterwarnings("always", module="multiprocessing")), True),
    (lambda: (warnings.simplefilter("ignore"),
              warnings.filterwarnings("always", message="This process")), True),
    (lambda: (warnings.simplefilter("ignore"),
              warnings.filterwarnings("always", message="other")), False),
    (lambda: (warnings.simplefilter("ignore"),   # the line of multiprocessing's fork call
              warnings.filterwarnings("always", module="multiprocessing",
                                      lineno=_fork_line())), True),
    (lambda: (warnings.simplefilter("ignore"),
              warnings.filterwarnings("always", module="multiprocessing",
                                      lineno=_fork_line() + 1)), False),
])
def test_the_fork_warning_is_suppressed_only_where_it_would_show(setup, shown):
    """Python 3.12+'s "multi-threaded fork" DeprecationWarning is only suppressed
    (with catch_warnings, whose reset of the shown-warnings records is the price)
    where the filters would let it through."""
    from fastloader import pool

    with warnings.catch_warnings():
        warnings.resetwarnings()
        for action, message, category, module, lineno in _default_filters():
            warnings.filterwarnings(action, message=message, category=category,
                                    module=module, lineno=lineno, append=True)
        setup()
        assert pool._fork_warning_would_show() is shown


def _fork_line():
    import inspect
    import multiprocessing.popen_fork
    lines, first = inspect.getsourcelines(multiprocessing.popen_fork.Popen._launch)
    return next(first + i for i, line in enumerate(lines) if "self.pid = os.fork()" in line)


def _default_filters():
    """A fresh interpreter's filters (pytest adds its own to this process's)."""
    out = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import warnings, json
        pattern = lambda p: getattr(p, "pattern", p) or ""
        print(json.dumps([(a, pattern(m), c.__name__, pattern(mod), ln)
                          for a, m, c, mod, ln in warnings.filters]))""")],
        capture_output=True, text=True, timeout=120,
        env=dict(os.environ, PYTHONWARNINGS=""))
    import builtins
    return [(a, m, getattr(builtins, c), mod, ln) for a, m, c, mod, ln in json.loads(out.stdout)]


@pytest.mark.parametrize("num_workers", [0, 2])
def test_the_profiler_records_the_event_names_torchs_loader_records(num_workers):
    """A trace (or a filter on it) finds the DataLoader's next() under torch's names."""
    from torch.profiler import ProfilerActivity, profile

    def names(cls):
        loader = cls(list(range(6)), batch_size=2, num_workers=num_workers,
                     **({"multiprocessing_context": "fork"} if num_workers else {}))
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            batches = [b.tolist() for b in loader]
        assert batches == [[0, 1], [2, 3], [4, 5]]
        return sorted({e.name for e in prof.events() if "DataLoader" in e.name})

    theirs = names(TorchDataLoader)
    assert theirs, "torch's loader recorded no event"
    assert names(DataLoader) == theirs


def _views_and_empty(samples):
    base = torch.stack(samples)
    return {"base": base, "view": base[1:], "empty": torch.zeros(0, dtype=torch.int64)}


def test_batches_arrive_on_the_cpu_under_a_default_device():
    """torch.set_default_device() (or `with torch.device(...)`) in the training
    process: batches are rebuilt on the CPU as torch's are (a view in a batch
    failed: its tensor was made on the default device, which refused the CPU
    storage; an empty one was made there)."""
    def batch(cls):
        loader = cls([torch.tensor(i) for i in range(8)], batch_size=4, num_workers=1,
                     multiprocessing_context="fork", collate_fn=_views_and_empty)
        it = iter(loader)   # (torch's draws its base seed with .item(): not on meta)
        with torch.device("meta"):
            return next(it)

    theirs, ours = batch(TorchDataLoader), batch(DataLoader)
    for key in ("base", "view", "empty"):
        assert ours[key].device == theirs[key].device == torch.device("cpu"), key
        assert torch.equal(ours[key], theirs[key]), key
    assert ours["view"].untyped_storage().data_ptr() == ours["base"].untyped_storage().data_ptr()


class _NoRepr:
    def __repr__(self):
        raise RuntimeError("no repr")


class _RaisesOnAnyIndex(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        raise KeyError("the dataset's error")


def test_an_index_whose_repr_raises_still_gets_the_datasets_error():
    """fastloader names the index in a worker's error; an index whose repr()
    raised killed the worker ("exited unexpectedly") instead of the dataset's
    error arriving, as with torch."""
    errors = []
    for cls in (TorchDataLoader, DataLoader):
        loader = cls(_RaisesOnAnyIndex(), sampler=[_NoRepr()] * 4, batch_size=2, num_workers=1,
                     multiprocessing_context="fork", timeout=60)
        with pytest.raises(KeyError) as info:
            next(iter(loader))
        errors.append(str(info.value))
    assert all("the dataset's error" in e for e in errors), errors
    assert "whose repr() raised RuntimeError" in errors[1], errors[1]
