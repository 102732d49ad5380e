"""The worker protocol's numbers: Python (fastloader/protocol.py), the C header and
the built module must agree, kind for kind. A kind added or renumbered on one
side only would make a worker and its main process misread each other."""
import os
import pickle
import re

import pytest

from fastloader import _core, protocol

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# csrc/protocol.h once the C side has its own protocol header; ring.h before that
HEADERS = [os.path.join(ROOT, "csrc", name) for name in ("protocol.h", "ring.h")]
_ENUM_ENTRY = re.compile(r"\bFL_(TASK|RES|WHERE)_([A-Z_]+)\s*=\s*(\d+)u?\b")


def header_constants():
    path = next((p for p in HEADERS if os.path.exists(p)), None)
    if path is None:
        pytest.skip("no C sources next to the tests (an installed package)")
    with open(path) as f:
        text = f.read()
    return {f"{group}_{name}": int(value) for group, name, value in _ENUM_ENTRY.findall(text)}


def python_constants():
    return {**protocol.TASKS, **protocol.RESULTS, **protocol.WHERES}


def test_python_kinds_equal_the_c_header():
    c = header_constants()
    py = python_constants()
    # every kind the header defines, Python has with the same number
    assert {k: py.get(k) for k in c} == c
    # and Python defines nothing the header lacks, except RES_DEAD when the header
    # predates it (it was a literal in the C sources: module.c)
    assert set(py) - set(c) <= {"RES_DEAD"}, set(py) - set(c)


def test_python_kinds_equal_the_built_module():
    for name, value in python_constants().items():
        if hasattr(_core, name):
            assert getattr(_core, name) == value, name
    exported = {n for n in dir(_core) if re.fullmatch(r"(TASK|RES|WHERE)_[A-Z_]+", n)}
    assert exported <= set(python_constants()), exported - set(python_constants())
    for name in ("TASK_PICKLE", "TASK_SHUTDOWN", "TASK_CONTROL", "TASK_RESUME", "RES_DEAD",
                 "RES_BATCH", "RES_ERROR", "RES_ITER_END", "RES_RESUMED", "RES_BATCH_SNAP"):
        assert name in exported, f"_core no longer exports {name}"


def test_kinds_are_distinct_within_each_group():
    for group in (protocol.TASKS, protocol.RESULTS, protocol.WHERES):
        assert len(set(group.values())) == len(group), group


def test_control_messages_are_typed_and_checked():
    for message in (protocol.Restore({"k": 3}), protocol.Replay([1, 2])):
        assert protocol.decode_control(protocol.encode_control(message)) == message
        assert type(protocol.decode_control(protocol.encode_control(message))) is type(message)
    # the string-tuple messages of before are refused on both sides
    with pytest.raises(TypeError, match="not a control message"):
        protocol.encode_control(("restore", {}))
    with pytest.raises(TypeError, match="not a control message"):
        protocol.decode_control(pickle.dumps(("replay", 1)))
