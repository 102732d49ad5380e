"""A one-time warning for datasets whose metadata every worker will copy.

A big Python list, tuple, dict or set held by the dataset (file names, labels,
annotations) costs each worker a private copy: forked workers copy the pages they
read (reading an object writes its reference count), and spawn/forkserver workers
unpickle a copy at start-up. The iterator calls ``warn_if_heavy_metadata`` when it
starts workers; it names the attribute, the estimated cost per worker and the fix
(``fastloader.PackedStringArray`` / ``fastloader.PackedArray``).

Silence it with ``warnings.filterwarnings("ignore", category=HeavyMetadataWarning)``.
"""
from __future__ import annotations

import itertools
import sys
import threading
import types
import warnings
from dataclasses import dataclass
from typing import List, Optional

from . import _core
from .sharing import resolve_start_method
from .warn_site import stacklevel_outside

__all__ = ["HeavyMetadataWarning", "warn_if_heavy_metadata", "find_heavy_metadata"]

ITEM_THRESHOLD = 100_000          # items in one container
BYTES_THRESHOLD = 64 << 20        # estimated bytes of one container and its items
_SAMPLE = 64                      # items measured to estimate the rest
_MAX_DEPTH = 3                    # dataset.attr.attr.attr (Subset -> dataset -> names)
_MAX_CHILDREN = 32                # small containers of datasets (ConcatDataset) we look into
_MIB = 1 << 20


class HeavyMetadataWarning(UserWarning):
    """A dataset keeps metadata in Python containers that every worker copies."""


@dataclass(frozen=True)
class Finding:
    path: str            # "dataset.names", "dataset.dataset.samples", ...
    type_name: str       # "list", "dict", "numpy object array", ...
    items: int
    nbytes: int          # estimated: the container plus its items
    all_str: bool        # the sampled items are all str
    numeric: bool = False  # the sampled items are all int / float / bool


_warned: set = set()
_lock = threading.Lock()


def _deep_size(obj, depth: int = 0, budget: Optional[list] = None) -> int:
    """sys.getsizeof of obj and (a few levels of) what it contains."""
    if budget is None:
        budget = [200]
    budget[0] -= 1
    size = sys.getsizeof(obj, 64)
    if depth >= 3 or budget[0] <= 0:
        return size
    if isinstance(obj, dict):
        for k, v in itertools.islice(obj.items(), 32):
            size += _deep_size(k, depth + 1, budget) + _deep_size(v, depth + 1, budget)
    elif isinstance(obj, (list, tuple, set, frozenset)):
        for v in itertools.islice(obj, 32):
            size += _deep_size(v, depth + 1, budget)
    return size


def _sample(container) -> list:
    n = len(container)
    if isinstance(container, (list, tuple)):
        step = max(1, n // _SAMPLE)
        return [container[i] for i in range(0, n, step)][:_SAMPLE]
    if isinstance(container, dict):
        return list(itertools.islice(container.items(), _SAMPLE))
    return list(itertools.islice(container, _SAMPLE))


def _examine(value) -> Optional[tuple]:
    """(type name, items, estimated bytes, all str) for a container worth a warning."""
    if isinstance(value, (list, tuple, dict, set, frozenset)):
        n = len(value)
        if n == 0:
            return None
        sample = _sample(value)
        per_item = sum(_deep_size(x) for x in sample) / max(1, len(sample))
        nbytes = int(sys.getsizeof(value) + per_item * n)
        if n <= ITEM_THRESHOLD and nbytes <= BYTES_THRESHOLD:
            return None
        if isinstance(value, dict):
            all_str = all(isinstance(k, str) and isinstance(v, str) for k, v in sample)
            numeric = False
        else:
            all_str = all(isinstance(x, str) for x in sample)
            numeric = all(isinstance(x, (int, float)) for x in sample)
        return type(value).__name__, n, nbytes, all_str, numeric
    np = sys.modules.get("numpy")
    if np is not None and isinstance(value, np.ndarray) and value.dtype == object:
        n = int(value.size)
        if n <= ITEM_THRESHOLD:
            return None
        flat = value.reshape(-1)
        step = max(1, n // _SAMPLE)
        sample = [flat[i] for i in range(0, n, step)][:_SAMPLE]
        per_item = sum(_deep_size(x) for x in sample) / max(1, len(sample))
        nbytes = int(value.nbytes + per_item * n)
        return "NumPy object array", n, nbytes, all(isinstance(x, str) for x in sample)
    return None


def _pandas_object_values(value):
    """The Python-object values behind a pandas Series (object dtype, or strings
    kept as Python str: StringDtype with "python" storage), else None. Arrow-backed
    and numeric columns hold no per-item Python objects: nothing to copy."""
    np = sys.modules.get("numpy")
    dtype = value.dtype
    if getattr(dtype, "kind", None) == "O" and isinstance(dtype, np.dtype):
        return value.to_numpy(copy=False)
    if getattr(dtype, "storage", None) == "python":
        arr = getattr(value.array, "_ndarray", None)   # no copy where pandas has one
        return arr if arr is not None else value.to_numpy(dtype=object)
    return None


def _pandas_findings(value, where) -> Optional[List[Finding]]:
    """Findings for a pandas DataFrame (per column: `df['col']`, and its index),
    Series (and its index) or Index; None for anything else. pandas objects are
    looked at through their columns, never through their internals (block
    managers), which the attribute walk would miss."""
    pd = sys.modules.get("pandas")
    if pd is None or not isinstance(value, (pd.DataFrame, pd.Series, pd.Index)):
        return None
    if isinstance(value, pd.Index):
        columns, index = [(None, value)], None
    else:
        columns = value.items() if isinstance(value, pd.DataFrame) else [(None, value)]
        index = value.index
    found = []
    for name, column in columns:
        values = _pandas_object_values(column)
        if values is None:
            continue
        info = _examine(values)
        if info is None:
            continue
        _, n, nbytes, all_str = info[:4]
        path = where if name is None else f"{where}[{name!r}]"
        if isinstance(column, pd.Index):
            kind = "pandas Index"
        else:
            kind = "pandas column" if name is not None else "pandas Series"
        found.append(Finding(path, f"{kind} of Python objects", n, nbytes, all_str))
    if index is not None:   # e.g. a DataFrame indexed by file name
        found.extend(_pandas_findings(index, f"{where}.index") or [])
    return found


def _attributes(obj):
    """(name, value) of an object's instance attributes (__dict__ and __slots__)."""
    try:
        yield from list(vars(obj).items())
    except TypeError:
        pass
    seen = set()
    for klass in type(obj).__mro__:
        slots = klass.__dict__.get("__slots__", ())
        if isinstance(slots, str):
            slots = (slots,)
        for name in slots:
            if name in seen or name in ("__dict__", "__weakref__"):
                continue
            seen.add(name)
            try:
                yield name, getattr(obj, name)
            except AttributeError:
                pass


def _is_holder(value) -> bool:
    """An object whose attributes may hold metadata (a wrapped dataset, an index
    object), as opposed to a function, class, module or the packed arrays themselves."""
    if isinstance(value, (type, types.ModuleType, types.FunctionType, types.MethodType,
                          types.BuiltinFunctionType, _core.PackedView, str, bytes, int,
                          float, complex, bool)):
        return False
    return hasattr(value, "__dict__") or hasattr(type(value), "__slots__")


def find_heavy_metadata(dataset, root: str = "dataset") -> List[Finding]:
    """The big Python containers reachable from `dataset` through attributes (a few
    levels deep, through wrapped datasets such as Subset or ConcatDataset)."""
    found: List[Finding] = []
    visited = set()

    def check(value, where, depth, inside=False):
        """One attribute's value, or (inside=True) a value in a small container
        attribute, such as `self.splits = {"train": df}`."""
        if id(value) in visited:
            return
        frames = _pandas_findings(value, where)
        if frames is not None:
            visited.add(id(value))
            found.extend(frames)
            return
        if not inside and isinstance(value, (list, tuple, dict)) \
                and 0 < len(value) <= _MAX_CHILDREN:
            # a few items: name the big one inside (a DataFrame, a list of names),
            # else judge the container as a whole (a few huge blobs)
            before = len(found)
            items = value.items() if isinstance(value, dict) else enumerate(value)
            for key, child in items:
                check(child, f"{where}[{key!r}]", depth, inside=True)
            if len(found) > before:
                return
        info = _examine(value)
        if info is not None:
            visited.add(id(value))
            found.append(Finding(where, *info))
        elif _is_holder(value):
            visit(value, where, depth + 1)

    def visit(obj, path, depth):
        if id(obj) in visited or depth > _MAX_DEPTH:
            return
        visited.add(id(obj))
        for name, value in _attributes(obj):
            check(value, f"{path}.{name}", depth)

    try:
        info = _examine(dataset)   # DataLoader(list_of_samples) is a container itself
        if info is not None:
            found.append(Finding(root, *info))
        else:
            visit(dataset, root, 0)
    except Exception:   # a warning must never break a loader
        pass
    return found


def _message(f: Finding, dataset, num_workers: int, method: str) -> str:
    mib = f.nbytes / _MIB
    total = mib * num_workers
    holder = type(dataset).__qualname__ if f.path != "dataset" else "the dataset itself"
    if f.type_name == "NumPy object array":
        what = "a NumPy array of Python objects"
    elif f.type_name.startswith("pandas"):
        what = f"a {f.type_name}"
    else:
        what = f"a Python {f.type_name}"
    if method == "fork":
        how = ("each forked worker copies the pages it reads (reading a Python object "
               "writes its reference count)")
    else:
        how = f"each '{method}' worker unpickles its own copy at start-up"
    short = f.path.split(".")[-1]   # "names", or "df['path']" for a pandas column
    if f.numeric:
        fix = f"store it as a NumPy array (np.asarray({short})) or a tensor: no object per item"
    elif f.all_str:
        fix = (f"store it as fastloader.PackedStringArray({short})" +
               (" (for a dict: keys and values as two arrays)" if f.type_name == "dict" else ""))
    else:
        fix = (f"store it as fastloader.PackedArray({short}) (records) or "
               "fastloader.PackedStringArray (strings)" +
               (", e.g. the keys and the values as two arrays" if f.type_name == "dict" else ""))
    return (f"fastloader: `{f.path}` ({holder}) is {what} of {f.items:,} items, about "
            f"{mib:,.0f} MiB; with {num_workers} DataLoader worker"
            f"{'s' if num_workers != 1 else ''} ('{method}') {how}: about {mib:,.0f} MiB "
            f"per worker, {total:,.0f} MiB in all. To share one copy instead, {fix}. "
            "(Shown once.)")


def warn_if_heavy_metadata(dataset, num_workers: int, start_method=None) -> List[Finding]:
    """Warn (HeavyMetadataWarning, once per dataset class and attribute per process)
    when a loader about to start `num_workers` workers with `start_method` ('fork',
    'spawn', 'forkserver', a multiprocessing context, or None for the default) has a
    dataset holding a big Python container: over ~100k items or ~64 MiB estimated.
    Returns what it found (warned or not)."""
    if not num_workers or num_workers <= 0:
        return []
    findings = find_heavy_metadata(dataset)
    if not findings:
        return findings
    method = resolve_start_method(start_method)
    for f in findings:
        key = (type(dataset).__module__, type(dataset).__qualname__, f.path)
        with _lock:
            if key in _warned:
                continue
            _warned.add(key)
        # at the user's `for batch in loader`
        warnings.warn(_message(f, dataset, num_workers, method), HeavyMetadataWarning,
                      stacklevel=stacklevel_outside("fastloader", "torch"))
    return findings


def _reset_once_registry() -> None:
    """Forget which warnings were shown (for tests)."""
    with _lock:
        _warned.clear()
