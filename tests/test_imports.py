"""No import cycles in the Python layer.

Every fastloader module is imported first, in a process that has imported no
fastloader module (a cycle shows as an ImportError or a half-initialised module only
for some entry points), then all of them in forward and in reverse order, also in
fresh interpreters. And no module may import a fastloader
module inside a function, which is how a cycle gets hidden; the few lazy imports
that exist for another reason are listed below with that reason."""
import ast
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import fastloader

PACKAGE_DIR = os.path.dirname(os.path.abspath(fastloader.__file__))
MODULES = sorted(f"fastloader.{m.name}" for m in pkgutil.iter_modules([PACKAGE_DIR])
                 if not m.name.startswith("_core"))

# (module file, imported module) -> why it is imported inside a function
JUSTIFIED_LAZY = {
    ("__main__.py", "fastloader.doctor"):
        "`python -m fastloader --help` must stay fast; the doctor imports torch",
    ("doctor.py", "fastloader"):
        "the doctor must run when the C extension is broken: it reaches the package's "
        "public names only where it needs them",
}


def _import_in_fresh_interpreter(modules):
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    env = dict(os.environ, FASTLOADER_INSTALL="0")
    return subprocess.run([sys.executable, "-c", code, *modules], capture_output=True,
                          text=True, timeout=240, env=env)


def test_the_module_list_is_complete():
    assert "fastloader.dataloader" in MODULES and "fastloader.worker" in MODULES
    assert len(MODULES) >= 20, MODULES


# Run by the test below: one interpreter imports what fastloader imports from outside
# (torch, numpy) and then forks a child per order, which imports that order's modules.
# Each child is fresh to fastloader, and costs ~0.1 s where a new interpreter's torch
# import costs ~1.6 s here (the test took 67 s with one interpreter per module). The fully fresh
# interpreters of test_all_modules_in_one_interpreter_forward_and_reverse stay.
_FORK_PER_ORDER = """
import importlib, json, os, sys, traceback
import numpy, torch
for order in json.loads(sys.argv[1]):
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            for name in order:
                importlib.import_module(name)
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stderr.flush()
        os._exit(code)
    if os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0:
        print("FAILED with first", order[0], file=sys.stderr, flush=True)
"""


def test_every_module_imports_first():
    # Every module first once, then the rest, forward and reversed: a cycle fails for
    # some first module only.
    orders = []
    for modules in (MODULES, MODULES[::-1]):
        orders += [[first, *(m for m in modules if m != first)] for first in modules]
    env = dict(os.environ, FASTLOADER_INSTALL="0")
    done = subprocess.run([sys.executable, "-c", _FORK_PER_ORDER, json.dumps(orders)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0 and "FAILED" not in done.stderr, done.stderr[-6000:]


def test_all_modules_in_one_interpreter_forward_and_reverse():
    for modules in (MODULES, MODULES[::-1]):
        done = _import_in_fresh_interpreter(modules)
        assert done.returncode == 0, done.stderr[-3000:]


def _imports_inside_functions(path):
    """(line, imported fastloader module) for every import inside a function."""
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in ast.walk(fn):
            if isinstance(node, ast.ImportFrom):
                if node.level > 0:
                    base = "fastloader" + ("." + node.module if node.module else "")
                    names = [base] if node.module else [f"fastloader.{a.name}"
                                                        for a in node.names]
                    found += [(node.lineno, n) for n in names]
                elif node.module and node.module.split(".")[0] == "fastloader":
                    found.append((node.lineno, node.module))
            elif isinstance(node, ast.Import):
                found += [(node.lineno, a.name) for a in node.names
                          if a.name.split(".")[0] == "fastloader"]
    return found


def test_no_fastloader_import_inside_a_function():
    offenders = []
    for name in sorted(os.listdir(PACKAGE_DIR)):
        if not name.endswith(".py"):
            continue
        for line, module in _imports_inside_functions(os.path.join(PACKAGE_DIR, name)):
            if (name, module) not in JUSTIFIED_LAZY:
                offenders.append(f"{name}:{line} imports {module}")
    assert not offenders, ("imports inside functions (a hidden cycle? import at the top, "
                           "or list the reason in JUSTIFIED_LAZY):\n" + "\n".join(offenders))


def test_the_scan_sees_a_hidden_cycle(tmp_path):
    # the static check itself: each spelling of a function-level import is caught
    src = tmp_path / "m.py"
    src.write_text("def f():\n    from .dataloader import x\n"
                   "def g():\n    from . import pool\n"
                   "def h():\n    import fastloader.worker\n"
                   "def k():\n    import numpy\n")
    assert _imports_inside_functions(str(src)) == [
        (2, "fastloader.dataloader"), (4, "fastloader.pool"), (6, "fastloader.worker")]


def test_benchmarks_never_import_tests():
    # tests may use benchmark datasets; the reverse would make `python -m benchmarks.x`
    # depend on the test tree
    bench_dir = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                             "benchmarks")
    offenders = []
    for name in sorted(os.listdir(bench_dir)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(bench_dir, name)) as f:
            tree = ast.parse(f.read(), name)
        for node in ast.walk(tree):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{name}:{node.lineno} imports {m}" for m in modules
                          if m.split(".")[0] == "tests"]
    assert not offenders, offenders
