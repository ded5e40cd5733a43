"""The value codec: exact round trips (also over the wire), refs for what cannot go by value, and
errors that say where the bad value was."""

from __future__ import annotations

import collections
import dataclasses
import enum
import math
from collections import Counter
from collections.abc import Mapping
from typing import Any, NamedTuple

import msgspec
import numpy as np
import pydantic
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_server.wire.codec import TORCH_DTYPES, CodecError, Encoder
from bridge_server.wire.decoder import Decoder
from vllm_bridge.v1 import bridge_pb2 as pb

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")

QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted(
    {str(v).removeprefix("torch."): v for v in vars(torch).values()
     if isinstance(v, torch.dtype) and v not in QUANTIZED}.items()
)


class Refs:
    """A stand-in for the worker's ref table."""

    def __init__(self) -> None:
        self.objects: dict[str, object] = {}

    def make_ref(self, obj: object) -> pb.Ref:
        ref_id = f"w1.{len(self.objects)}"
        self.objects[ref_id] = obj
        return pb.Ref(id=ref_id, worker_id="w1", type_name=type(obj).__qualname__, repr=repr(obj)[:40])

    def resolve_ref(self, ref: pb.Ref) -> object:
        return self.objects[ref.id]


def no_ref(obj: object) -> pb.Ref:
    raise AssertionError(f"{obj!r} should have gone by value")


def codec(types: Mapping[str, type] | None = None, **encoder_args: Any) -> tuple[Encoder, Decoder, Refs]:
    refs = Refs()
    allowed: Mapping[str, type] = types or {}
    return Encoder(refs.make_ref, **encoder_args), Decoder(refs.resolve_ref, allowed.get), refs


def qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def canon(x: object) -> object:
    """A hashable, type-tagged stand-in for a set element (so nan and 1-vs-True compare exactly)."""
    if isinstance(x, float):
        return ("float", "nan" if math.isnan(x) else x.hex())
    if isinstance(x, tuple):
        return ("tuple", tuple(canon(i) for i in x))
    if isinstance(x, frozenset):
        return ("frozenset", frozenset(canon(i) for i in x))
    return (type(x).__name__, x)


def same(a: Any, b: Any) -> bool:
    """Type-exact deep equality: nan equals nan, -0.0 differs from 0.0, dict order counts."""
    if type(a) is not type(b):
        return False
    if isinstance(a, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and raw(a) == raw(b)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return len(a) == len(b) and all(
            same(ka, kb) and same(va, vb) for (ka, va), (kb, vb) in zip(a.items(), b.items()))
    if isinstance(a, (set, frozenset)):
        return Counter(map(canon, a)) == Counter(map(canon, b))
    return a == b


def wire(value: pb.Value) -> pb.Value:
    return pb.Value.FromString(value.SerializeToString())


def make_tensor(dtype: torch.dtype, shape: tuple[int, ...], data: bytes) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def tensor_bytes(draw: Any, dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    n = math.prod(shape) * dtype.itemsize
    if dtype == torch.bool:
        return bytes(draw(st.lists(st.integers(0, 1), min_size=n, max_size=n)))
    return bytes(draw(st.binary(min_size=n, max_size=n)))


@st.composite
def tensors(draw: Any) -> torch.Tensor:
    name, dtype = draw(st.sampled_from(ALL_DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 3), max_size=3)))
    return make_tensor(dtype, shape, tensor_bytes(draw, dtype, shape))


I64 = 2**63
ints = st.one_of(
    st.integers(),
    st.sampled_from([0, -1, 1, I64 - 1, I64, -I64, -I64 - 1, 2**64, -(2**64)]),
    st.integers(min_value=2**64, max_value=2**300),
    st.integers(min_value=-(2**300), max_value=-(2**64)),
)
scalars = st.one_of(st.none(), st.booleans(), ints, st.floats(), st.text(), st.binary())
hashables = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3).map(tuple), st.frozensets(inner, max_size=3)),
    max_leaves=8,
)
values = st.recursive(
    st.one_of(scalars, tensors()),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.lists(inner, max_size=4).map(tuple),
        st.sets(hashables, max_size=4),
        st.frozensets(hashables, max_size=4),
        st.dictionaries(hashables, inner, max_size=4),
    ),
    max_leaves=24,
)


# --- property tests --------------------------------------------------------------------------------

@settings(max_examples=300, deadline=None)
@given(values)
def test_round_trip_is_exact(x: object) -> None:
    encoder, decoder = Encoder(no_ref), Decoder(no_ref, lambda name: None)  # type: ignore[arg-type]
    value = encoder.encode(x)
    assert same(decoder.decode(value), x)
    assert same(decoder.decode(wire(value)), x)


@settings(deadline=None)
@given(hashables)
def test_hashables_round_trip_as_map_keys_and_set_members(key: object) -> None:
    encoder, decoder, _ = codec()
    for x in ({key: 1}, {key}, frozenset({key}), (key,)):
        assert same(decoder.decode(wire(encoder.encode(x))), x)


def test_the_helper_is_type_exact() -> None:
    assert not same(1, True) and not same(1, 1.0) and not same((1,), [1]) and not same({1}, frozenset({1}))
    assert same(float("nan"), float("nan")) and not same(0.0, -0.0)
    assert not same({1: 1, 2: 2}, {2: 2, 1: 1}) and not same({1}, {True})


# --- scalars ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("obj", "kind"),
    [(None, "null"), (True, "bool"), (0, "int"), (I64 - 1, "int"), (-I64, "int"), (I64, "big_int"),
     (-I64 - 1, "big_int"), (1.0, "float"), ("s", "str"), (b"b", "bytes"), (bytearray(b"b"), "bytes"),
     (memoryview(b"b"), "bytes"), ([], "list"), ((), "tuple"), (set(), "set"), (frozenset(), "frozenset"),
     ({}, "map"), (np.int64(3), "int"), (np.float32(1.5), "float"), (np.bool_(True), "bool"),
     (np.uint64(2**64 - 1), "big_int")],
)
def test_kind_on_the_wire(obj: object, kind: str) -> None:
    encoder, decoder, refs = codec()
    value = wire(encoder.encode(obj))
    assert value.WhichOneof("kind") == kind
    assert not refs.objects


def test_int_stays_int_and_none_stays_null() -> None:
    encoder, decoder, _ = codec()
    for x in (0, 7, -(2**40), 2**100):
        got = decoder.decode(wire(encoder.encode(x)))
        assert type(got) is int and got == x
    value = wire(encoder.encode([None, 1, 1.0]))
    assert [v.WhichOneof("kind") for v in value.list.items] == ["null", "int", "float"]
    assert same(decoder.decode(value), [None, 1, 1.0])


def test_lists_of_ints_go_packed_and_everything_else_item_by_item() -> None:
    class Color(enum.IntEnum):
        RED = 1

    encoder, decoder, _ = codec()
    for obj in ([1, -2, 3], [I64 - 1, -I64], [0]):
        value = wire(encoder.encode(obj))
        assert value.WhichOneof("kind") == "ints" and list(value.ints.values) == obj
        assert same(decoder.decode(value), obj)
    # Anything that would not come back exactly as it went stays a list of Values.
    for obj in ([], [1, True], [1, 2.0], [1, I64], [1, Color.RED], [np.int64(1)], [1, None]):
        value = wire(encoder.encode(obj))
        assert value.WhichOneof("kind") == "list", obj
        assert [v.WhichOneof("kind") for v in value.list.items] == [
            wire(encoder.encode(x)).WhichOneof("kind") for x in obj]
    # Tuples and sets keep their kind.
    assert wire(encoder.encode((1, 2))).WhichOneof("kind") == "tuple"
    assert wire(encoder.encode({1, 2})).WhichOneof("kind") == "set"


def test_floats_are_exact() -> None:
    encoder, decoder, _ = codec()
    for x in (math.inf, -math.inf, -0.0, 5e-324, 1.7976931348623157e308):
        assert same(decoder.decode(wire(encoder.encode(x))), x)
    assert math.isnan(decoder.decode(wire(encoder.encode(math.nan))))  # type: ignore[arg-type]


def test_subclasses_of_builtins_go_as_the_builtin() -> None:
    encoder, decoder, _ = codec()
    od = collections.OrderedDict([("b", 1), ("a", 2)])
    dd = collections.defaultdict(list, {3: [1]})
    assert same(decoder.decode(encoder.encode(od)), {"b": 1, "a": 2})
    assert same(decoder.decode(encoder.encode(dd)), {3: [1]})
    assert same(decoder.decode(encoder.encode(memoryview(b"abcd")[1:3])), b"bc")


def test_atom_arrives_as_str() -> None:
    _, decoder, _ = codec()
    assert decoder.decode(pb.Value(atom="ok")) == "ok"


# --- tensors ---------------------------------------------------------------------------------------

def test_the_codec_knows_every_torch_dtype() -> None:
    assert dict(ALL_DTYPES) == TORCH_DTYPES
    assert {"bfloat16", "float8_e4m3fn", "uint16", "complex32", "bool"} <= set(TORCH_DTYPES)


@pytest.mark.parametrize(("name", "dtype"), ALL_DTYPES, ids=[n for n, _ in ALL_DTYPES])
@pytest.mark.parametrize("shape", [(), (0,), (2, 3), (3, 0, 2)], ids=str)
def test_every_dtype_round_trips(name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    encoder, decoder, refs = codec()
    n = math.prod(shape) * dtype.itemsize
    data = bytes(i % 2 if dtype == torch.bool else (7 * i + 3) % 256 for i in range(n))
    t = make_tensor(dtype, shape, data)
    value = wire(encoder.encode(t))
    assert value.WhichOneof("kind") == "tensor" and not refs.objects
    assert (value.tensor.dtype, list(value.tensor.shape), value.tensor.data) == (name, list(shape), data)
    got = decoder.decode(value)
    assert isinstance(got, torch.Tensor) and same(got, t)
    if got.numel():
        got.reshape(-1).view(torch.uint8)[0] ^= 1  # writable, and not sharing the message's bytes
        assert value.tensor.data == data


def test_bfloat16_values() -> None:
    encoder, decoder, _ = codec()
    t = torch.tensor([1.5, -2.0, math.inf, -0.0, 3.0e38], dtype=torch.bfloat16)
    got = decoder.decode(wire(encoder.encode(t)))
    assert isinstance(got, torch.Tensor) and got.dtype == torch.bfloat16 and torch.equal(got, t)


def test_views_and_autograd_tensors_go_by_value() -> None:
    encoder, decoder, _ = codec()
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    for t in (base.T, base[:, 1::2], base.clone().requires_grad_(), torch.tensor([1 + 2j]).conj(), -base[0]):
        got = decoder.decode(encoder.encode(t))
        assert isinstance(got, torch.Tensor) and torch.equal(got, t.detach().resolve_conj().resolve_neg())


def test_sparse_and_oversized_tensors_go_as_refs() -> None:
    encoder, decoder, refs = codec(tensor_max_bytes=16)
    small, big, sparse = torch.zeros(4), torch.zeros(5), torch.zeros(2, 2).to_sparse()
    assert encoder.encode(small).WhichOneof("kind") == "tensor"
    for t in (big, sparse):
        value = encoder.encode(t)
        assert value.WhichOneof("kind") == "ref"
        assert decoder.decode(wire(value)) is t
    assert list(refs.objects.values()) == [big, sparse]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_gpu_tensor_comes_back_on_cpu() -> None:
    encoder, decoder, _ = codec()
    got = decoder.decode(encoder.encode(torch.arange(3, device="cuda")))
    assert isinstance(got, torch.Tensor) and got.device.type == "cpu" and got.tolist() == [0, 1, 2]


def test_numpy_arrays_arrive_as_torch_tensors() -> None:
    encoder, decoder, refs = codec()
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    cases = [a, a.T, a.astype(">f4"), np.array(True), np.zeros((0, 2), np.uint16), np.array([1 + 2j])]
    for arr in cases:
        got = decoder.decode(wire(encoder.encode(arr)))
        assert isinstance(got, torch.Tensor) and got.shape == arr.shape
        assert np.array_equal(got.numpy(), arr)
    for odd in (np.array(["a"]), np.array([object()]), np.array([1.0], dtype=np.longdouble)):
        assert encoder.encode(odd).WhichOneof("kind") == "ref"
    assert len(refs.objects) == 3


# --- records and enums -----------------------------------------------------------------------------

@dataclasses.dataclass
class Point:
    x: int
    y: list[float]
    label: str = "p"
    derived: int = dataclasses.field(init=False, default=0)


@dataclasses.dataclass(frozen=True)
class Frozen:
    a: tuple[int, ...]
    b: Point | None = None


class Pair(NamedTuple):
    left: int
    right: str


class Spec(msgspec.Struct, rename="camel"):
    max_tokens: int
    stop: list[str] = []


class Model(pydantic.BaseModel):
    name: str = pydantic.Field(alias="Name")
    n: int = 1


RECORDS: list[tuple[object, list[str]]] = [
    (Point(1, [2.0]), ["x", "y", "label", "derived"]),
    (Frozen((1, 2), Point(3, [])), ["a", "b"]),
    (Pair(1, "r"), ["left", "right"]),
    (Spec(max_tokens=5, stop=["\n"]), ["max_tokens", "stop"]),
    (Model(Name="m", n=2), ["name", "n"]),
]
RECORD_TYPES = {qualname(c): c for c in (Point, Frozen, Pair, Spec, Model)}


@pytest.mark.parametrize(("obj", "names"), RECORDS, ids=lambda x: type(x).__name__)
def test_records_go_by_value(obj: object, names: list[str]) -> None:
    encoder, decoder, refs = codec(RECORD_TYPES)
    value = wire(encoder.encode(obj))
    assert value.WhichOneof("kind") == "record" and not refs.objects
    assert value.record.type_name == qualname(type(obj))
    assert [f.name for f in value.record.fields] == names
    assert decoder.decode(value) == obj and type(decoder.decode(value)) is type(obj)
    plain = Decoder(refs.resolve_ref, lambda name: None).decode(value)
    assert isinstance(plain, dict) and list(plain) == names


def test_non_init_dataclass_fields_are_restored() -> None:
    encoder, decoder, _ = codec(RECORD_TYPES)
    p = Point(1, [])
    p.derived = 42
    got = decoder.decode(encoder.encode(p))
    assert isinstance(got, Point) and got.derived == 42


class Color(enum.Enum):
    RED = "r"
    BLUE = (1, 2)


class Level(enum.IntEnum):
    LOW = 1


class Mode(enum.StrEnum):
    FAST = "fast"


class Perm(enum.Flag):
    R = 1
    W = 2


ENUM_TYPES = {qualname(c): c for c in (Color, Level, Mode, Perm)}


@pytest.mark.parametrize(
    "member", [Color.RED, Color.BLUE, Level.LOW, Mode.FAST, Perm.R, Perm.R | Perm.W, Perm(0)], ids=repr)
def test_enums_round_trip(member: enum.Enum) -> None:
    encoder, decoder, refs = codec(ENUM_TYPES)
    value = wire(encoder.encode(member))
    assert value.WhichOneof("kind") == "enum" and value.enum.type_name == qualname(type(member))
    assert decoder.decode(value) is member
    assert not refs.objects  # a non-scalar member value is not worth a ref


def test_enum_value_is_sent_when_it_is_a_scalar() -> None:
    encoder, _, _ = codec()
    assert encoder.encode(Color.RED).enum.value.str == "r"
    assert encoder.encode(Level.LOW).enum.value.int == 1


# --- refs, cycles and depth -------------------------------------------------------------------------

def test_other_objects_go_as_refs_and_come_back() -> None:
    encoder, decoder, refs = codec()
    thing, fn = object(), len
    value = wire(encoder.encode({"thing": thing, "fn": fn, "n": 1}))
    assert [e.value.WhichOneof("kind") for e in value.map.entries] == ["ref", "ref", "int"]
    got = decoder.decode(value)
    assert isinstance(got, dict) and got["thing"] is thing and got["fn"] is fn
    with pytest.raises(KeyError):  # an unknown ref fails with the resolver's own error
        decoder.decode(pb.Value(ref=pb.Ref(id="w1.gone")))


def test_cycles_do_not_hang() -> None:
    encoder, decoder, refs = codec()
    loop: list[object] = [1]
    loop.append(loop)
    d: dict[str, object] = {}
    d["self"] = d
    got = decoder.decode(wire(encoder.encode(loop)))
    assert isinstance(got, list) and got[0] == 1 and got[1] is loop
    assert decoder.decode(encoder.encode(d)) == {"self": d}


def test_shared_subtrees_are_not_cycles() -> None:
    encoder, decoder, refs = codec()
    shared = [1]
    assert decoder.decode(encoder.encode([shared, shared])) == [[1], [1]] and not refs.objects


def test_deep_containers_go_as_a_ref() -> None:
    encoder, decoder, refs = codec(max_depth=3)
    inner = [1, "one"]    # (a list of ints alone is a leaf on the wire: packed, no Values inside)
    got = decoder.decode(encoder.encode([[[inner]]]))
    assert got == [[[inner]]] and got[0][0][0] is inner  # type: ignore[index]
    assert list(refs.objects.values()) == [inner]


@dataclasses.dataclass
class Box:
    item: object


def nested(depth: int) -> object:
    """Maps and records (the kinds that cost the most wire nesting) around an enum and a null."""
    deepest: object = [Perm(0), None]
    for i in range(depth):
        deepest = {i: deepest} if i % 2 else Box(deepest)
    return deepest


def test_the_default_depth_survives_the_wire() -> None:
    encoder, _, refs = codec()
    request = pb.CallRequest(args=[encoder.encode(nested(encoder.max_depth + 5))])
    assert len(refs.objects) == 1  # cut off at max_depth
    assert pb.CallRequest.FromString(request.SerializeToString()) == request
    # Why the default is not deeper: protobuf (upb) refuses to parse, or even copy, messages nested
    # past 100, and one more level of maps or records would cross that.
    deeper = codec(max_depth=encoder.max_depth + 1)[0].encode(nested(40))
    with pytest.raises(Exception, match="MaxDepth"):
        pb.CallRequest.FromString(pb.CallRequest(args=[deeper]).SerializeToString())


# --- errors ----------------------------------------------------------------------------------------

def in_list(bad: pb.Value) -> pb.Value:
    return pb.Value(list=pb.Items(items=[pb.Value(int=0), bad]))


def tensor_value(dtype: str, shape: list[int], data: bytes) -> pb.Value:
    return pb.Value(tensor=pb.Tensor(dtype=dtype, shape=shape, data=data))


def record_value(type_name: str, **fields: pb.Value) -> pb.Value:
    record = pb.Record(type_name=type_name, fields=[pb.Field(name=k, value=v) for k, v in fields.items()])
    return pb.Value(record=record)


ERRORS: list[tuple[str, pb.Value, str, str]] = [
    ("bad dtype", in_list(tensor_value("float33", [1], b"\0" * 4)), "value[1]", "float33"),
    ("quantized dtype", in_list(tensor_value("qint8", [1], b"\0")), "value[1]", "qint8"),
    ("byte length", in_list(tensor_value("float32", [2, 3], b"\0" * 23)), "value[1]", "24 bytes"),
    ("negative dim", in_list(tensor_value("int8", [-1], b"")), "value[1]", "[-1]"),
    ("empty, but its sizes overflow torch's", in_list(tensor_value("float32", [2**32, 2**32, 0], b"")), "value[1]",
     "fits in 64 bits"),
    ("bool bytes", in_list(tensor_value("bool", [1], b"\x02")), "value[1]", "bool"),
    ("unhashable set element",
     pb.Value(set=pb.Items(items=[pb.Value(int=1), pb.Value(list=pb.Items())])), "value[1]", "hashable"),
    ("unhashable map key",
     pb.Value(map=pb.Map(entries=[pb.Entry(key=pb.Value(list=pb.Items()), value=pb.Value(int=1))])),
     "value[<key #0>]", "hashable"),
    ("duplicate map key",
     pb.Value(map=pb.Map(entries=[pb.Entry(key=pb.Value(str="k"), value=pb.Value(int=1))] * 2)),
     "value[<key #1>]", "duplicate key 'k'"),
    ("empty value", pb.Value(), "value", "empty Value"),
    ("nested empty value",
     pb.Value(map=pb.Map(entries=[pb.Entry(key=pb.Value(str="k"), value=in_list(pb.Value()))])),
     "value['k'][1]", "empty Value"),
    ("bad big_int", in_list(pb.Value(big_int="12x")), "value[1]", "12x"),
    ("unknown enum", in_list(pb.Value(enum=pb.Enum(type_name="os.Nope", name="A"))), "value[1]",
     "unknown enum type os.Nope"),
    ("no such member", pb.Value(enum=pb.Enum(type_name=qualname(Color), name="GREEN")), "value",
     f"{qualname(Color)} has no member GREEN"),
    ("record rejects fields", record_value(qualname(Pair), left=pb.Value(int=1)), "value", "right"),
    ("record unknown field", record_value(qualname(Point), x=pb.Value(int=1), y=pb.Value(list=pb.Items()),
                                          z=pb.Value(int=1)), "value", "unknown fields ['z']"),
    ("not a record type", record_value(qualname(Color)), "value", "a record type"),
    ("record field error", record_value("x.Y", f=pb.Value()), "value.f", "empty Value"),
]


@pytest.mark.parametrize(("case", "value", "path", "detail"), ERRORS, ids=[e[0] for e in ERRORS])
def test_codec_errors_name_the_path(case: str, value: pb.Value, path: str, detail: str) -> None:
    _, decoder, _ = codec({**RECORD_TYPES, **ENUM_TYPES})
    with pytest.raises(CodecError) as caught:
        decoder.decode(wire(value))
    assert caught.value.path == path
    assert str(caught.value).startswith(f"{path}: expected ")
    assert detail in str(caught.value)


def test_decode_takes_a_base_path() -> None:
    _, decoder, _ = codec()
    with pytest.raises(CodecError, match=r"^args\[2\]\[1\]: expected"):
        decoder.decode(in_list(pb.Value()), "args[2]")


class _Out:
    """A plain class declared as a record, like vLLM's RequestOutput."""

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: list[int]) -> None:
        self.request_id, self.prompt_token_ids, self.token_ids = request_id, prompt_token_ids, token_ids


def test_a_streams_constant_fields_are_encoded_once_and_stay_exact() -> None:
    fields = ("request_id", "prompt_token_ids", "token_ids")
    calls: list[object] = []
    enc = Encoder(make_ref=lambda o: pb.Ref(id="x"), records={_Out: fields},
                  constant_fields={_Out: frozenset({"request_id", "prompt_token_ids"})}, memo={})
    prompt = list(range(500))
    decoder = Decoder(resolve_ref=lambda r: r, resolve_type=lambda n: None)
    first = enc.encode(_Out("r1", prompt, [1]))
    prompt_value = first.record.fields[1].value
    original_fill = enc._fill

    def counting_fill(obj: object, *args: object) -> None:
        calls.append(obj)
        original_fill(obj, *args)  # type: ignore[arg-type]

    object.__setattr__(enc, "_fill", counting_fill)
    second = enc.encode(_Out("r1", prompt, [1, 2]))
    assert prompt not in calls                     # copied from the memo, not encoded again
    assert second.record.fields[1].value == prompt_value
    assert decoder.decode(second) == {"request_id": "r1", "prompt_token_ids": prompt, "token_ids": [1, 2]}
    other_prompt = list(range(3))                  # a different object is encoded afresh
    assert decoder.decode(enc.encode(_Out("r1", other_prompt, [3])))["prompt_token_ids"] == [0, 1, 2]


def test_a_record_s_fields_count_against_the_request_s_bound_of_items() -> None:
    """A record's fields are decoded one by one as a map's entries are: ten megabytes of empty
    records' fields held a worker's loop 18 s, where lists, sets and maps were bounded."""
    import grpc

    from bridge_server.wire.errors import BridgeError

    decoder = Decoder(resolve_ref=lambda r: r, resolve_type=lambda n: None, max_str_chars=100)
    record = pb.Value(record=pb.Record(type_name="x", fields=[pb.Field(name=f"f{i}", value=pb.Value(int=i))
                                                                for i in range(60)]))
    decoder.begin()
    assert decoder.decode(record) == {f"f{i}": i for i in range(60)}
    with pytest.raises(BridgeError) as err:
        decoder.decode(record)           # the same request: 120 items in all
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "items in all" in err.value.message
