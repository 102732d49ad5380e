"""The batch codec on its own: round trips of every supported type, views into
the encoded buffer, and random or truncated bytes that must raise, never crash."""
import collections
import json
import os
import pickle
import random
import struct
import subprocess
import sys

import numpy as np
import pytest
import torch

import fastloader  # noqa: F401  (registers the codec hooks)
from fastloader import _core
from fastloader._codec_hooks import CODE, DTYPES, DeferredStack
from tests.support.aliasing_datasets import containers_holding_themselves
from tests.support.helpers import run_python

Point = collections.namedtuple("Point", "x y")


class Custom:
    def __init__(self, t, label):
        self.t = t
        self.label = label


def _same(a, b):
    assert type(a) is type(b), (type(a), type(b))
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert a.requires_grad == b.requires_grad
        assert a.layout == b.layout
        if a.layout != torch.strided:
            a, b = a.to_dense(), b.to_dense()
        a, b = a.detach(), b.detach()
        try:
            assert torch.equal(a, b)
        except NotImplementedError:
            # a dtype with no arithmetic (uint1-7, bits8...): compare its bytes
            raw = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
            assert torch.equal(a.view(raw[a.element_size()]), b.view(raw[b.element_size()]))
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, Custom):
        _same(a.t, b.t)
        _same(a.label, b.label)
    elif isinstance(a, float) and a != a:
        assert b != b
    else:
        assert a == b


SAMPLES = [
    None, True, False, 0, -1, 2**63 - 1, 2**70, 1.5, float("nan"), "", "héllo \u2603",
    "\udc80 lone surrogate", b"\x00bytes", [], (), {}, [1, "a", None],
    {"a": torch.arange(6).reshape(2, 3), 3: (1.0, b"x"), None: [np.int64(4)]},
    Point(torch.ones(2), "y"), [Point(1, 2), Point(3, 4)],
    np.arange(10, dtype=np.float32).reshape(2, 5), np.zeros((0, 3)), np.array(5),
    np.arange(12)[::2], np.float16(2.5), np.bool_(True), np.complex64(1 + 2j),
    torch.randn(3, 4), torch.randn(4, 3).t(), torch.zeros(0), torch.tensor(7),
    torch.randn(2, 2).to(torch.bfloat16),
    torch.randn(3, requires_grad=True), (1 + 2j) * torch.ones(2, dtype=torch.complex64).conj(),
    torch.randn(3).to_sparse(), Custom(torch.arange(3), 9),
    collections.OrderedDict(a=torch.ones(1)), {"nested": [[[torch.ones(1)]]]},
    # aliasing: storage table, views, memo references, Fortran order (tests/transport/test_aliasing.py)
    (lambda t: {"t": t, "v": t[1:, ::2], "again": t, "i": t.view(torch.int32)})(
        torch.arange(12.0).reshape(3, 4)),
    (lambda lst: [lst, lst, (lst,)])([torch.ones(2), "x"]),
    np.asfortranarray(np.arange(12.0).reshape(3, 4)), torch.ones(3).expand(2, 3),
]
if hasattr(torch, "uint16"):   # torch >= 2.3
    SAMPLES.append(torch.tensor([1, 2], dtype=torch.uint16))


# a sparse tensor is rebuilt by torch's own function, as torch's transport does it,
# which warns (as it does there)
@pytest.mark.filterwarnings("ignore:Sparse invariant checks are implicitly disabled:UserWarning")
@pytest.mark.parametrize("obj", SAMPLES, ids=[type(s).__name__ + str(i) for i, s in enumerate(SAMPLES)])
def test_round_trip(obj):
    _same(obj, _core.decode(_core.encode(obj)))


@pytest.mark.parametrize("name", ["bits8", "bits16", "bits1x8", "bits2x4", "bits4x2"])
def test_bits_tensors_travel_as_their_bytes(name):
    # pickle cannot rebuild these (torch's own reduction fails on load)
    dtype = getattr(torch, name, None)
    if dtype is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    raw = torch.int16 if torch.empty(0, dtype=dtype).element_size() == 2 else torch.uint8
    t = torch.arange(6, dtype=raw).reshape(2, 3).view(dtype)
    out = _core.decode(_core.encode({"t": t, "v": t[1:]}))
    assert out["t"].dtype == dtype and out["t"].shape == (2, 3)
    assert out["t"].view(raw).tolist() == [[0, 1, 2], [3, 4, 5]]
    assert out["v"].view(raw).tolist() == [[3, 4, 5]]


def test_tensors_are_views_of_the_buffer_and_keep_it_alive():
    batch = {"x": torch.arange(1000, dtype=torch.float64), "y": np.arange(10)}
    out = _core.decode(_core.encode(batch))
    x, y = out["x"], out["y"]
    del out
    # the array's base chain ends at the owner object, not at a private copy
    assert y.base is not None and type(y.base).__name__ == "BatchOwner"
    assert x.untyped_storage().nbytes() == 8000
    x.add_(1)   # writable, as torch's batches are
    assert torch.equal(x, torch.arange(1, 1001, dtype=torch.float64))


def test_deferred_stack_is_stacked_into_the_buffer():
    ts = [torch.full((2, 3), float(i)) for i in range(4)]
    out = _core.decode(_core.encode([DeferredStack(ts, (4, 2, 3), CODE[torch.float32])]))
    assert torch.equal(out[0], torch.stack(ts))


def test_unpicklable_object_names_its_type():
    with pytest.raises(Exception, match="lambda|local"):
        _core.encode({"f": lambda: 1})


CORRUPT = "corrupt batch encoding"


def _blobs():
    return [_core.encode(s) for s in SAMPLES if not isinstance(s, Custom)]


def test_truncated_bytes_raise_value_error():
    for blob in _blobs():
        for cut in range(0, len(blob), max(1, len(blob) // 16)):
            with pytest.raises(ValueError, match=CORRUPT):
                _core.decode(blob[:cut])


def test_random_bytes_raise_value_error():
    rng = random.Random(1234)
    for _ in range(500):
        with pytest.raises(ValueError, match=CORRUPT):
            _core.decode(bytes(rng.randrange(256) for _ in range(rng.randint(0, 300))))


def _small(obj, limit=1 << 20):
    """Whether `obj` can be re-encoded and compared: little to copy (a mutated shape
    can be huge), and no sparse tensor. A sparse tensor travels as torch's own
    pickle, which (as torch.load without check_sparse_tensor_invariants, and as
    torch's DataLoader transport) does not validate indices: flipped bytes there
    make a tensor whose use writes out of bounds. Batches come from our own workers."""
    if isinstance(obj, torch.Tensor):
        return obj.layout == torch.strided and obj.numel() <= limit
    if isinstance(obj, np.ndarray):
        return obj.size <= limit
    if isinstance(obj, dict):
        return all(_small(v, limit) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return all(_small(v, limit) for v in obj)
    return True


def mutation_outcomes(seed=1234, rounds=3000, crash_file=None):
    """Flips bytes of encoded samples and decodes them: each either decodes into a
    batch that survives its own round trip, or raises ValueError from the codec
    itself (a UnicodeDecodeError for a str), or the element's own error from the
    Python code the codec calls (a pickled element's unpickling, a tensor's
    constructor). Anything else fails an assertion. Returns the counts."""
    rng = random.Random(seed)
    blobs = _blobs()
    outcomes = collections.Counter()
    for _ in range(rounds):
        blob = bytearray(rng.choice(blobs))
        for _ in range(rng.randint(1, 8)):
            blob[rng.randrange(len(blob))] = rng.randrange(256)
        if crash_file:   # the input of a crash, for the report
            with open(crash_file, "wb") as f:
                f.write(blob)
        try:
            out = _core.decode(bytes(blob))
        except ValueError as exc:
            if CORRUPT in str(exc) or isinstance(exc, UnicodeDecodeError):
                outcomes["codec error"] += 1
                continue
            # e.g. "unsupported pickle protocol": a pickled element's own error
            assert exc.__traceback__.tb_next is not None, f"{type(exc).__name__}: {exc}"
            outcomes["element error"] += 1
            continue
        except (pickle.UnpicklingError, AttributeError, ImportError, EOFError, OverflowError,
                RuntimeError, TypeError, KeyError, IndexError) as exc:
            # raised in Python code the decoder called, not by the decoder itself
            assert exc.__traceback__.tb_next is not None, f"{type(exc).__name__}: {exc}"
            outcomes["element error"] += 1
            continue
        outcomes["decoded"] += 1
        if _small(out):
            _same(out, _core.decode(_core.encode(out)))
    return dict(outcomes)


def test_mutated_bytes_decode_consistently_or_raise_precisely(tmp_path):
    # In a child interpreter: a crash in native code must fail this test with its
    # input, not take the whole test session down.
    crash_file = tmp_path / "input.bin"
    code = ("import json, sys; from tests.transport.test_codec import mutation_outcomes; "
            "print(json.dumps(mutation_outcomes(crash_file=sys.argv[1])))")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-X", "faulthandler", "-c", code, str(crash_file)],
                          capture_output=True, text=True, timeout=600, cwd=root)
    if done.returncode < 0:
        pytest.fail(f"native crash (signal {-done.returncode}) on input "
                    f"{crash_file.read_bytes().hex()}\n{done.stderr[-1500:]}")
    assert done.returncode == 0, done.stderr[-3000:]
    outcomes = json.loads(done.stdout.strip().splitlines()[-1])
    assert outcomes.get("codec error", 0) > 1000 and outcomes.get("decoded", 0) > 100, outcomes


def test_storage_table_and_references_are_checked():
    """Bytes that point a view outside its storage, or a reference at an object not yet
    decoded, raise ValueError (never a read outside the buffer)."""
    t = torch.arange(8.0)
    blob = bytearray(_core.encode([t[2:4], t[2:4]]))
    assert _core.decode(bytes(blob))[0].tolist() == [2.0, 3.0]
    for i in range(64, len(blob)):
        for v in (0xFF, 0x7F, 0x40):
            bad = bytearray(blob)
            bad[i] = v
            try:
                out = _core.decode(bytes(bad))
            except (ValueError, RuntimeError, TypeError, IndexError):
                continue
            for x in out if isinstance(out, list) else []:
                if isinstance(x, torch.Tensor):
                    x.sum()   # a view that decoded must lie inside its storage


def _shift_first_storage(obj, by):
    """obj's encoding with its first storage's data `by` bytes further on (the
    header's total grown to keep it inside): an offset the encoder never writes."""
    blob = bytearray(_core.encode(obj))
    total = int.from_bytes(blob[24:32], "little")
    blob[24:32] = (total + 64).to_bytes(8, "little")
    off = int.from_bytes(blob[64:72], "little")   # storage table entry 0: off
    blob[64:72] = (off + by).to_bytes(8, "little")
    return bytes(blob + bytes(64))


@pytest.mark.parametrize("obj", [torch.arange(64, dtype=torch.float64),
                                 torch.arange(64, dtype=torch.float64)[3:9]],
                         ids=["tensor", "view"])
def test_data_off_its_elements_alignment_is_refused(obj):
    """The encoder places every block at 64 bytes; a float64 storage one byte off
    decoded into a tensor whose elements torch's kernels then read misaligned."""
    # (one element further on: aligned, so it decodes, one element later)
    assert _core.decode(_shift_first_storage(obj, 8))[:-1].tolist() == obj[1:].tolist()
    with pytest.raises(ValueError, match="alignment"):
        _core.decode(_shift_first_storage(obj, 1))


def _crafted(stream, data=bytes(64), stab=b""):
    """A batch encoding around `stream` (csrc/codec.c's header: magic, version,
    stream length, data offset, total, storage table length)."""
    stream_off = 64 + len(stab)
    data_off = (stream_off + len(stream) + 63) // 64 * 64
    total = data_off + len(data)
    blob = bytearray(total)
    blob[:40] = struct.pack("<IIQQQQ", 0x464C4254, 2, len(stream), data_off, total, len(stab))
    blob[64:stream_off] = stab
    blob[stream_off:stream_off + len(stream)] = stream
    blob[data_off:] = data
    return bytes(blob)


T_TUPLE, T_TENSOR, T_TV = 9, 13, 16   # csrc/codec.c's tags


def test_shapes_whose_strides_overflow_are_refused():
    """A second tensor on one storage of 0 bytes (a 0 in its shape) with other sizes
    of 2**62: its contiguous strides overflowed int64 (undefined behaviour) and
    wrapped to 0."""
    f4 = np.dtype(np.float32).num

    def tensor(sizes):
        return (bytes([T_TENSOR]) + struct.pack("<iiiQ", CODE[torch.float32], 0, f4, len(sizes))
                + b"".join(struct.pack("<q", n) for n in sizes) + struct.pack("<Q", 0))
    empty = struct.pack("<QQQ", 0, 0, 0)   # storage 0: off, nbytes, window start
    fine = bytes([T_TUPLE]) + struct.pack("<Q", 2) + tensor([0]) + tensor([0, 3, 5])
    assert [t.stride() for t in _core.decode(_crafted(fine, stab=empty))] == [(1,), (15, 5, 1)]
    huge = bytes([T_TUPLE]) + struct.pack("<Q", 2) + tensor([0]) + tensor([0] + [1 << 62] * 3)
    with pytest.raises(ValueError, match="corrupt"):
        _core.decode(_crafted(huge, stab=empty))


@pytest.mark.parametrize("tag", ["tensor", "view"])
def test_a_tensor_header_that_disagrees_with_its_dtype_code_is_refused(tag):
    """A dtype code past the ones this torch has raised a bare IndexError; bytes of
    another NumPy type than the code's were taken as they said (a uint8 header
    with a float64 code decoded at an odd address, which the alignment check, done
    with the bytes' type, exists to refuse); a gradient asked of an integer dtype
    raised torch's own error. Each is now a corrupt header."""
    u1, f8 = np.dtype(np.uint8).num, np.dtype(np.float64).num
    stab = struct.pack("<QQQ", 1, 8, 0)        # 8 bytes at offset 1 of the data

    def header(code, typenum, grad=0):
        if tag == "tensor":
            return (bytes([T_TENSOR]) + struct.pack("<iiiQ", code, grad, typenum, 1)
                    + struct.pack("<qQ", 1 if typenum == f8 else 8, 0))
        return (bytes([T_TV]) + struct.pack("<iii", code, grad, typenum)
                + struct.pack("<Qqq", 0, 0, 1) + struct.pack("<qq", 1 if typenum == f8 else 8, 1))

    data = bytes(range(64))
    fine = _core.decode(_crafted(header(CODE[torch.uint8], u1), data, stab=stab))
    assert fine.dtype == torch.uint8 and fine.tolist() == list(range(1, 9))
    for code, typenum, grad in [(len(DTYPES), u1, 0), (63, u1, 0), (-1, u1, 0),
                                (CODE[torch.float64], u1, 0), (CODE[torch.bfloat16], u1, 0),
                                (CODE[torch.uint8], f8, 0), (CODE[torch.int64], u1, 0),
                                (CODE[torch.uint8], u1, 1)]:
        with pytest.raises(ValueError, match="corrupt batch encoding [(]tensor (view )?header"):
            _core.decode(_crafted(header(code, typenum, grad), data, stab=stab))


def test_a_view_whose_extent_wraps_is_refused_by_the_decoder():
    """A view's last element at 2**64 - 1: its extent check computed (last + 1) * size,
    which wrapped to 0 and passed (torch refused it later, by luck of its own check)."""
    u1 = np.dtype(np.uint8).num
    big = (1 << 63) - 1
    stream = (bytes([T_TV]) + struct.pack("<iii", CODE[torch.uint8], 0, u1)
              + struct.pack("<Qqq", 0, 0, 3)
              + struct.pack("<qq", 2, big) + struct.pack("<qq", 2, big) + struct.pack("<qq", 2, 1))
    with pytest.raises(ValueError, match="extent"):
        _core.decode(_crafted(stream, stab=struct.pack("<QQQ", 0, 8, 0)))


def test_a_chain_of_memo_marks_is_refused_without_deep_recursion():
    blob = bytearray(_core.encode([[1]]))
    memo_tag = blob[64]                   # the outer list is marked for the memo
    stream_len = int.from_bytes(blob[8:16], "little")
    chain = bytes([memo_tag]) * 1_000_000 + bytes(blob[64:64 + stream_len])
    hdr = bytearray(blob[:64])
    hdr[8:16] = len(chain).to_bytes(8, "little")
    data_off = (64 + len(chain) + 63) // 64 * 64
    hdr[16:24] = data_off.to_bytes(8, "little")
    hdr[24:32] = data_off.to_bytes(8, "little")
    crafted = bytes(hdr) + chain + bytes(data_off - 64 - len(chain))
    with pytest.raises(ValueError, match="corrupt"):
        _core.decode(crafted)


def test_a_batch_nested_deeper_than_the_codec_goes_travels_pickled_below():
    """Torch's queue pickles a batch, which nests as deep as Python's recursion
    limit allows; the codec stops at 200 levels (the decoder's bound on hostile
    input). Deeper containers travel pickled whole, their tensors still out of
    band: identity across the boundary holds. It raised RecursionError."""
    t = torch.arange(6.0)
    deep = [t, "x", {"k": (t, 2)}]
    for _ in range(400):
        deep = [deep, 1]
    out = _core.decode(_core.encode([t, deep]))
    inner, levels = out[1], 0
    while isinstance(inner[0], list):
        assert inner[1] == 1
        inner, levels = inner[0], levels + 1
    assert levels == 400
    assert inner[0] is out[0] and inner[2]["k"][0] is out[0]
    assert inner[1] == "x" and type(inner[2]["k"]) is tuple and inner[2]["k"][1] == 2


def test_a_batch_that_contains_itself_keeps_its_recursion_exact():
    """torch's queue pickles a batch, and pickle's memo keeps a recursive container
    one object; the codec gave a list that holds itself ~196 distinct copies of its
    outer levels. Now such a batch travels pickled whole, with its tensors still
    out of band (each once) and identity across the batch kept."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    batch = containers_holding_themselves(t, t[8:])
    blob = _core.encode(batch)
    assert len(blob) < t.nbytes + 4096            # the tensor's bytes once, not pickled
    out = _core.decode(blob)
    assert out["loop"][2] is out["loop"] and out["loop"][0] is out["t"]
    assert out["table"]["self"] is out["table"]
    assert out["table"]["view"].untyped_storage().data_ptr() == out["t"].data_ptr()
    assert out["pair"][0][0] is out["pair"] and out["pair"][1] is out["t"]
    assert torch.equal(out["t"], t) and torch.equal(out["table"]["view"], t[8:])


class Box:
    """A pickled object (the codec does not know it) that refers back to its batch."""

    def __init__(self, ref=None):
        self.ref = ref


class ListSubclass(list):
    pass


def _through_an_object():
    batch = [torch.ones(2)]
    batch.append(Box(batch))
    return batch, lambda out: out[1].ref is out


def _through_an_ordered_dict():
    batch = {"t": torch.ones(2)}
    batch["od"] = collections.OrderedDict(back=batch)
    return batch, lambda out: out["od"]["back"] is out


def _through_a_list_subclass():
    batch = [torch.ones(2)]
    batch.append(ListSubclass([batch]))
    return batch, lambda out: out[1][0] is out


def _longer_than_the_codec_goes():
    batch = [torch.ones(2)]
    node = batch
    for i in range(250):
        node.append([i])
        node = node[-1]
    node.append(batch)

    def check(out):
        node = out
        for _ in range(251):
            node = node[-1]
        return node is out
    return batch, check


@pytest.mark.parametrize("make", [_through_an_object, _through_an_ordered_dict,
                                  _through_a_list_subclass, _longer_than_the_codec_goes],
                         ids=lambda f: f.__name__.strip("_"))
def test_a_recursion_through_a_pickled_part_stays_exact(make):
    """The codec pickles what it does not know (and containers below its depth); a
    pickle that reaches back to a container around it carried its own copy of that
    container. Now the batch is pickled whole, as torch's queue pickles it."""
    batch, same = make()
    out = _core.decode(_core.encode(batch))
    assert same(out)


def test_a_list_cleared_while_it_is_encoded_does_not_crash_the_worker():
    """An element's __reduce__ (user code the codec calls) that empties the list being
    encoded freed the items the codec was reading: a segfault."""
    code = (
        "import fastloader\n"
        "from fastloader import _core\n"
        "batch = []\n"
        "class Clears:\n"
        "    def __reduce__(self):\n"
        "        batch.clear()\n"
        "        return (int, (0,))\n"
        "batch.extend([Clears()] + [[i] * 3 for i in range(50)])\n"
        "out = _core.decode(_core.encode(batch))\n"
        "print(len(out), out[:2])\n")
    assert run_python(code, timeout=120).stdout.strip() == "51 [0, [0, 0, 0]]"


def test_a_memo_mark_before_a_reference_is_refused_and_deep_batches_still_decode():
    # every compound node is memo-marked: the mark must not cost a nesting level
    # (the encoder does not count it), and the marked node's tag is read once
    deep = [1]
    for _ in range(190):
        deep = [deep]
    assert _core.decode(_core.encode(deep)) == deep
    blob = bytearray(_core.encode([[1], [1]]))
    memo_tag = blob[64]
    ref_at = blob.index(bytes([memo_tag]), 65)   # the inner list's mark
    bad = bytearray(blob)
    bad[ref_at + 1] = memo_tag                   # mark followed by a mark
    with pytest.raises(ValueError, match="corrupt"):
        _core.decode(bytes(bad))


NUMPY_TYPES = [np.bool_, np.byte, np.ubyte, np.short, np.ushort, np.intc, np.uintc, np.int_,
               np.uint, np.longlong, np.ulonglong, np.half, np.single, np.double,
               np.longdouble, np.csingle, np.cdouble, np.clongdouble]


@pytest.mark.parametrize("kind", NUMPY_TYPES, ids=[t.__name__ for t in NUMPY_TYPES])
def test_numpy_scalars_and_arrays_arrive_with_the_types_pickle_gives(kind):
    """torch's queue pickles them: a longlong scalar arrives as an int64 (pickle
    names the dtype by its size, which on LP64 is long's), an array as an array of
    that dtype."""
    scalar, array = kind(3), np.arange(4).astype(kind)
    for obj in (scalar, array, np.asfortranarray(np.arange(6).reshape(2, 3).astype(kind))):
        theirs, ours = pickle.loads(pickle.dumps(obj)), _core.decode(_core.encode(obj))
        assert type(ours) is type(theirs)
        assert ours.dtype.num == theirs.dtype.num, (ours.dtype, theirs.dtype)
        assert np.array_equal(ours, theirs)


def test_an_arrays_dtype_metadata_arrives_as_pickle_keeps_it():
    """h5py marks enum and variable-length string dtypes with dtype metadata. torch's
    queue pickles an array, which keeps it; the codec sent dtype number, shape and
    bytes, and the metadata was lost (values right, dtype.metadata None)."""
    enum = np.dtype("u1", metadata={"enum": {"cat": 0, "dog": 1}})
    array = np.array([0, 1, 1, 0], dtype=enum)
    for batch in (array, [array, array], {"every_other": array[::2]}, (np.zeros(2), array)):
        theirs, ours = pickle.loads(pickle.dumps(batch)), _core.decode(_core.encode(batch))
        flat_theirs = theirs if isinstance(theirs, (list, tuple)) else \
            list(theirs.values()) if isinstance(theirs, dict) else [theirs]
        flat_ours = ours if isinstance(ours, (list, tuple)) else \
            list(ours.values()) if isinstance(ours, dict) else [ours]
        assert type(ours) is type(theirs)
        for a, b in zip(flat_ours, flat_theirs):
            assert a.dtype == b.dtype and a.dtype.metadata == b.dtype.metadata, (a.dtype, b.dtype)
            assert np.array_equal(a, b)
        if isinstance(batch, list):
            assert ours[0] is ours[1]   # one array twice stays one, as pickle's memo
    assert _core.decode(_core.encode(array)).dtype.metadata == {"enum": {"cat": 0, "dog": 1}}


def _claims(nbytes):
    """An array that claims `nbytes` bytes and uses one (a broadcast view)."""
    return np.broadcast_to(np.zeros(1, np.uint8), (nbytes,))


@pytest.mark.parametrize("count, each", [(4, 2 ** 62), (5, 2 ** 62), (1, 2 ** 61)])
def test_arrays_whose_sizes_add_up_past_any_memory_are_a_memory_error(count, each):
    """Each size fits on its own; their sum wrapped past 2**64 (four of 2**62 sum
    to 0), so the batch got a tiny slot and the copy wrote far past it."""
    with pytest.raises(MemoryError, match="too large to send"):
        _core.encode([_claims(each) for _ in range(count)])


def test_arrays_just_under_the_limit_are_still_sized_not_refused():
    # a real array's size is far below the limit: the check refuses nothing real
    arrays = [np.arange(10, dtype=np.int64), np.zeros((3, 4), np.float32)]
    _same(arrays, _core.decode(_core.encode(arrays)))
