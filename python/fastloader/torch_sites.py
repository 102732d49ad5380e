"""Calls made from the line of torch's dataloader module where torch makes them.

torch warns from its DataLoader code with ``stacklevel=2``: the worker-count
warning of ``check_worker_number_rationality()``, the ``pin_memory`` ones of
``_BaseDataLoaderIter.__init__`` and the hint for worker arguments that do not
pickle all point at the line of torch/utils/data/dataloader.py that called the
function that warned, and count as warnings of the module
``torch.utils.data.dataloader``. A project that silences them by module
(``warnings.filterwarnings("ignore", module="torch.utils.data")``, pytest's
``filterwarnings = ignore::UserWarning:torch.utils.data.dataloader``), or that
turns every other warning into an error, must see the same from fastloader, whose
own code makes those calls. Each site below is a function compiled under torch's
file name, its call placed at the line and columns of the same call in torch's
code, with torch's module as its globals: a warning through it is torch's, and a
traceback through it shows torch's frame, source line and carets (then
fastloader's frames, where torch's would show its own).

The places are found in torch's code objects at import, so they follow torch's
version. Where a call is not found (torch moved it, or something replaced torch's
function before fastloader was imported), the site still sits in torch's file and
module, at the first line of torch's function or else at line 1.
"""
from __future__ import annotations

import dis
import inspect
import types

from torch.utils.data import dataloader as _torch_dataloader

_GLOBALS = vars(_torch_dataloader)
_FILE = _torch_dataloader._BaseDataLoaderIter.__init__.__code__.co_filename
_CALLS = ("CALL", "CALL_FUNCTION", "CALL_METHOD", "CALL_KW", "CALL_FUNCTION_KW",
          "CALL_FUNCTION_EX")
_CALL_TEXT = "fn(*args, **kwargs"   # then padding, then ")"


def _torch_code(owner, name, unwrap=False):
    """The code object of `owner.name` if it is torch's own (in torch's file); with
    `unwrap`, of the function under any functools.wraps wrappers a library put on it."""
    fn = vars(owner).get(name) if owner is not None else None
    if unwrap and fn is not None:
        try:
            fn = inspect.unwrap(fn)
        except ValueError:   # a cycle of __wrapped__
            return None
    code = getattr(fn, "__code__", None)
    return code if isinstance(code, types.CodeType) and code.co_filename == _FILE else None


def _call_after_load(code, name):
    """(line, first column, end column) of the call that follows the first
    instruction of `code` loading `name` (a global, attribute or method); the
    columns are None where the bytecode has no positions (Python 3.10) or the
    call spans lines, and the line is None if `name` is never loaded."""
    line, loaded = None, False
    for ins in dis.get_instructions(code):
        positions = getattr(ins, "positions", None)   # Python >= 3.11
        if positions is not None and positions.lineno is not None:
            if not loaded:
                line = positions.lineno
            elif ins.opname in _CALLS:
                if positions.lineno == positions.end_lineno == line:
                    return line, positions.col_offset, positions.end_col_offset
                return line, None, None
        elif positions is None and type(ins.starts_line) is int and not loaded:
            line = ins.starts_line                  # Python 3.10 (3.13 has a bool)
        if not loaded and ins.opname.startswith("LOAD_") and ins.argval == name:
            loaded = True
            if positions is None:
                return line, None, None
    return (line, None, None) if loaded else (None, None, None)


def _site(code, name, func_name):
    """A function `site(fn, *args, **kwargs)` that returns `fn(*args, **kwargs)`,
    called from where torch's `code` calls the thing it loads as `name`."""
    line, col, end = _call_after_load(code, name) if code is not None else (None,) * 3
    line = line or (code.co_firstlineno if code is not None else 1)
    width = end - col if col is not None else 0
    if width > len(_CALL_TEXT) and line > 1:
        # the call covers torch's call's columns exactly, so that a traceback's
        # carets under torch's source line are where torch's would be
        source = ("\n" * (line - 2) + "def site(fn, *args, **kwargs): return \\\n"
                  + " " * col + _CALL_TEXT + " " * (width - len(_CALL_TEXT) - 1) + ")\n")
    else:
        source = "\n" * (line - 1) + "def site(fn, *args, **kwargs): return fn(*args, **kwargs)\n"
    module = compile(source, _FILE, "exec")
    site = next(c for c in module.co_consts if isinstance(c, types.CodeType))
    names = {"co_name": func_name}
    if hasattr(site, "co_qualname"):   # Python >= 3.11
        names["co_qualname"] = code.co_qualname if code is not None else func_name
    return types.FunctionType(site.replace(**names), _GLOBALS, func_name)


# torch's, before install() replaces it
_GET_ITERATOR = _torch_code(_torch_dataloader.DataLoader, "_get_iterator")
_MP_ITER = getattr(_torch_dataloader, "_MultiProcessingDataLoaderIter", None)
_MP_ITER_INIT = _torch_code(_MP_ITER, "__init__")

# DataLoader._get_iterator: `self.check_worker_number_rationality()`
check_worker_number = _site(_GET_ITERATOR, "check_worker_number_rationality", "_get_iterator")
# DataLoader._get_iterator: `return _MultiProcessingDataLoaderIter(self)`
new_multiprocessing_iter = _site(_GET_ITERATOR, "_MultiProcessingDataLoaderIter",
                                 "_get_iterator")
# _MultiProcessingDataLoaderIter.__init__: `super().__init__(loader)`
base_iter_init = _site(_MP_ITER_INIT, "__init__", "__init__")


# What the multiprocessing iterator's __init__ does differs between torch releases;
# fastloader reads it from the installed torch's own code (its constants and the
# names it uses), unwrapped where a library wrapped it before fastloader's import.
_MP_ITER_INIT_OWN = _torch_code(_MP_ITER, "__init__", unwrap=True)

# The hint it warns with when a worker cannot be started because its arguments do
# not pickle, where its code has one (2.13 does; 2.5 and older do not). Where its
# code cannot be found (replaced outright), the text of the releases that have one.
_PICKLE_HINT_START = "Got pickle error when attempting to start a worker Process."
_KNOWN_PICKLE_HINT = (
    "Got pickle error when attempting to start a worker Process. "
    "This might be because the worker Process arguments are not picklable. "
    "Python 3.14+ changed the multiprocessing start method in non-Mac POSIX platforms "
    "to 'forkserver', which requires the worker Process arguments to be picklable. "
    "You can also try multiprocessing.set_start_method('fork').")


def _pickle_hint(code):
    if code is None:
        return _KNOWN_PICKLE_HINT
    texts = [c for c in code.co_consts if isinstance(c, str)]
    # the sentence it has begun with so far, else (reworded) a long text about
    # pickling in a function that handles pickling errors
    hint = next((t for t in texts if t.startswith(_PICKLE_HINT_START)), None)
    if hint is None and "PicklingError" in code.co_names:
        hint = next((t for t in texts if "pickl" in t.lower() and len(t) > 40), None)
    return hint


pickle_hint = _pickle_hint(_MP_ITER_INIT_OWN)


def _check_args(code, text):
    """The AssertionError's args where this torch's multiprocessing iterator raises
    with `text` (2.13 does); none where it asserts without a message (2.5 and older:
    `assert self._num_workers > 0`)."""
    return (text,) if code is None or text in code.co_consts else ()


# the AssertionError args of the iterator's checks of num_workers and prefetch_factor
num_workers_check = _check_args(
    _MP_ITER_INIT_OWN, "num_workers must be greater than 0 for MultiProcessingDataLoaderIter")
prefetch_factor_check = _check_args(
    _MP_ITER_INIT_OWN, "prefetch_factor must be greater than 0 for MultiProcessingDataLoaderIter")

# Whether it asks for the pinning device's current index in the main thread without
# torch.accelerator (2.5 and older: torch.cuda.current_device(), which raises where
# there is no driver, from iter(); 2.13 asks torch.accelerator, only where one is)
asks_pin_device_in_main = (_MP_ITER_INIT_OWN is not None
                           and "current_device" in _MP_ITER_INIT_OWN.co_names
                           and "accelerator" not in _MP_ITER_INIT_OWN.co_names)
