"""python/fastloader/_core.pyi against the built module: every public name of the
module (functions, classes, their methods and properties, constants) is in the
stub and every name in the stub exists at runtime, and a function's parameters in
the stub are the runtime's where the C code declares a text signature.

(mypy.stubtest is stricter still, and also needs every C docstring's signature line
to carry `$self`; this test is the part of it that the build guarantees today.)"""
import ast
import inspect
import os
import re

import pytest

from fastloader import _core

STUB = os.path.join(os.path.dirname(os.path.abspath(_core.__file__)), "_core.pyi")


def _public(names):
    return {n for n in names if not n.startswith("_")}


def stub_tree():
    with open(STUB) as f:
        return ast.parse(f.read(), STUB)


def stub_names():
    """{top-level name: None or {member: ast node}} from the stub."""
    names = {}
    for node in stub_tree().body:
        if isinstance(node, ast.ClassDef):
            names[node.name] = {n.name: n for n in node.body
                                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            names[node.name].update({t.id: n for n in node.body if isinstance(n, ast.AnnAssign)
                                     for t in [n.target] if isinstance(t, ast.Name)})
        elif isinstance(node, ast.FunctionDef):
            names[node.name] = node
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names[node.target.id] = None
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    names[t.id] = None
    return names


def test_every_runtime_name_is_in_the_stub_and_back():
    stub = stub_names()
    runtime = _public(dir(_core))
    assert sorted(runtime - set(stub)) == [], "in _core but not in _core.pyi"
    assert sorted(_public(stub) - runtime) == [], "in _core.pyi but not in _core"


@pytest.mark.parametrize("cls", sorted(n for n, v in stub_names().items() if isinstance(v, dict)))
def test_class_members_match(cls):
    members = stub_names()[cls]
    runtime_cls = getattr(_core, cls)
    runtime = _public(n for n in dir(runtime_cls) if n in vars(runtime_cls))
    assert sorted(runtime - _public(members)) == [], f"{cls}: in _core, not in the stub"
    assert sorted(_public(members) - set(dir(runtime_cls))) == [], \
        f"{cls}: in the stub, not in _core"


def _stub_params(fn, method):
    args = fn.args
    params = [a.arg for a in args.posonlyargs + args.args]
    if method and params[:1] == ["self"]:
        params = params[1:]
    return params + [a.arg for a in args.kwonlyargs]


def _runtime_params(obj, name):
    """The parameter names the C code declares: its text signature, or else the
    signature line that opens its docstring ("name(a, b=1) -> type")."""
    try:
        sig = inspect.signature(obj)
        return [p.name for p in sig.parameters.values()
                if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    except (TypeError, ValueError):
        pass
    match = re.match(rf"{re.escape(name)}\((.*?)\)", (obj.__doc__ or "").lstrip())
    if match is None:
        return None   # the C code declares no signature: nothing to compare
    params = [p.split("=")[0].strip() for p in match.group(1).split(",")]
    return [p.lstrip("$") for p in params if p and p not in ("*", "/")
            and not p.startswith("*")]


def test_parameters_match_where_the_runtime_declares_them():
    mismatches, compared = [], 0
    for name, entry in stub_names().items():
        if isinstance(entry, ast.FunctionDef):
            pairs = [(name, entry, getattr(_core, name), False)]
        elif isinstance(entry, dict):
            pairs = [(f"{name}.{m}", node, getattr(getattr(_core, name), m, None), True)
                     for m, node in entry.items()
                     if isinstance(node, ast.FunctionDef) and not m.startswith("__")]
        else:
            continue
        for label, node, obj, method in pairs:
            runtime = (_runtime_params(obj, label.rsplit(".", 1)[-1])
                       if obj is not None else None)
            if runtime is None:
                continue
            compared += 1
            if method and runtime[:1] in (["self"], ["$self"]):
                runtime = runtime[1:]
            if runtime != _stub_params(node, method):
                mismatches.append(f"{label}: stub {_stub_params(node, method)} != "
                                  f"runtime {runtime}")
    assert not mismatches, "\n".join(mismatches)
    assert compared >= 10, f"only {compared} signatures could be compared"
