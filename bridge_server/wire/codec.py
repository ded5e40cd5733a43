"""The value codec: Python objects -> `vllm_bridge.v1.Value` (decoding is in `decoder.py`).

A round trip is exact for everything that goes by value (an int stays an int, a tuple stays a tuple,
a bfloat16 tensor keeps its bits). Whatever cannot go by value goes as a `Ref` minted by the caller's
`make_ref`, so encoding never fails on an unusual object. Numpy arrays go as tensors and so come back
as torch tensors: the wire has one tensor kind, and torch is what vLLM consumes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import time
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import msgspec
import numpy as np
import pydantic
import torch

from bridge_server.wire.errors import without_addresses
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["SCALAR_WRITERS", "TORCH_DTYPES", "CodecError", "Encoder", "FieldReader", "TooCostly", "field_reader",
           "qualified_name", "short_repr"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1

# From torch itself, so new dtypes work without a code change. Quantized dtypes (all named q...) carry
# a scale and zero point that raw bytes cannot express, so they never go by value.
TORCH_DTYPES: dict[str, torch.dtype] = {
    str(v).removeprefix("torch."): v for v in vars(torch).values()
    if isinstance(v, torch.dtype) and not str(v).startswith("torch.q")
}
# Numpy dtypes whose names and byte layout are those of the torch dtype of the same name.
_NUMPY_DTYPES = frozenset({"bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                           "float16", "float32", "float64", "complex64", "complex128"})


class TooCostly(Exception):
    """An encode stopped at its `work_limit`: the result is to be encoded in its turn."""

    def __init__(self, work: int) -> None:
        super().__init__(f"encoding took more than its bound of work ({work:,} items so far)")
        self.work = work


class CodecError(ValueError):
    """Bad input value; .path says where (e.g. "args[1]['key'][0]")."""

    path: str

    def __init__(self, path: str, expected: str, got: str) -> None:
        super().__init__(f"{path}: expected {expected}, got {got}")
        self.path, self.expected, self.got = path, expected, got


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def short_repr(obj: object, limit: int = 40) -> str:
    text = without_addresses(repr(obj))
    return text if len(text) <= limit else text[: limit - 3] + "..."


# --- encoding -------------------------------------------------------------------------------------
# Values are filled in place (child messages are never built and then copied into their parents), and
# dispatch is on the exact type first, so a call made of a few ints and strings never reaches the
# isinstance chains.

def _put_int(obj: Any, out: pb.Value) -> None:
    if _I64_MIN <= obj <= _I64_MAX:
        out.int = obj
    else:  # str() raises ValueError past sys.get_int_max_str_digits(), as int() would on the way back
        out.big_int = str(int(obj))


def _put(field: str) -> Callable[[Any, pb.Value], None]:
    return lambda obj, out: setattr(out, field, obj)


_SCALARS: dict[type, Callable[[Any, pb.Value], None]] = {
    type(None): lambda obj, out: out.null.SetInParent(), bool: _put("bool"), int: _put_int,
    float: _put("float"), str: _put("str"), bytes: _put("bytes"),
}
_SCALARS[bytearray] = _SCALARS[memoryview] = lambda obj, out: setattr(out, "bytes", bytes(obj))
# How each scalar type is written into a Value, by exact type (for the patcher, which writes the
# scalars it sends itself).
SCALAR_WRITERS: Mapping[type, Callable[[Any, pb.Value], None]] = _SCALARS
# Exact container types, then (in this order) the bases that subclasses such as OrderedDict match.
_CONTAINERS: dict[type, str] = {list: "list", tuple: "tuple", set: "set", frozenset: "frozenset", dict: "map"}


_MISSING = object()


def _present(obj: object, names: tuple[str, ...]) -> list[tuple[str, object]]:
    # An init=False field never set, or a msgspec UNSET one, is left out rather than sent as a ref.
    pairs = []
    for name in names:
        value = getattr(obj, name, _MISSING)
        if value is not _MISSING and value is not msgspec.UNSET:
            pairs.append((name, value))
    return pairs


_T = TypeVar("_T")


def _per_class(fn: Callable[[type], _T]) -> Callable[[type], _T]:
    """Memoizes a function of a class (functools.cache, typed for classes)."""
    return functools.cache(fn)  # type: ignore[arg-type]


@_per_class
def _record_plan(cls: type) -> Callable[[Any], list[tuple[str, object]]] | None:
    """How to list a by-value record's fields in declaration order, worked out once per class; None
    when instances of cls are not records."""
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        tuple_names: tuple[str, ...] = tuple(cls._fields)
        return lambda obj: list(zip(tuple_names, obj))
    if dataclasses.is_dataclass(cls):
        names = tuple(f.name for f in dataclasses.fields(cls))
    elif issubclass(cls, msgspec.Struct):
        names = tuple(cls.__struct_fields__)
    elif issubclass(cls, pydantic.BaseModel):
        model_names = tuple(cls.model_fields)
        return lambda obj: [(k, getattr(obj, k)) for k in model_names] + list((obj.__pydantic_extra__ or {}).items())
    else:
        return None
    return lambda obj: _present(obj, names)


def _record_fields(obj: object) -> list[tuple[str, object]] | None:
    """The fields of a by-value record in declaration order, or None when obj is not one."""
    plan = _record_plan(type(obj))
    return None if plan is None else plan(obj)


_SCALAR_BASES: dict[str, type] = {b.__name__: b for b in (int, float, str, bytes, bytearray)}


@_per_class
def _leaf_kind(cls: type) -> str | None:
    """Which by-value kind holding no other values instances of cls are, worked out once per class."""
    if issubclass(cls, enum.Enum):  # before int/str: IntEnum and StrEnum members are ints/strs
        return "enum"
    for base, kind in ((torch.Tensor, "tensor"), (np.ndarray, "ndarray"), (np.bool_, "np.bool_"),
                       (np.integer, "np.integer"), (np.floating, "np.floating")):
        if issubclass(cls, base):
            return kind
    return next((name for name, b in _SCALAR_BASES.items() if issubclass(cls, b)), None)


_type_name_of = _per_class(qualified_name)   # once per class: it is written into every record and enum
_INT_ONLY = {int}


class FieldReader:
    """How to read a record class's fields fast, worked out once per class: every field name in
    order, and a C getter of all their values at once. It applies to an object that has every field
    (none missing or msgspec UNSET), which is the usual case; for any other the encoder's own listing
    decides (`Encoder.record_fields`)."""

    __slots__ = ("names", "get", "check_unset")

    def __init__(self, names: tuple[str, ...], get: Callable[[Any], tuple[Any, ...]] | None, check_unset: bool) -> None:
        self.names = names
        self.get = get
        self.check_unset = check_unset

    def values(self, obj: Any) -> tuple[Any, ...] | None:
        get = self.get
        if get is None:
            return None
        try:
            values = get(obj)
        except AttributeError:
            return None
        if self.check_unset and _UNSET_ID in map(id, values):
            return None
        return values


_UNSET_ID = id(msgspec.UNSET)


@functools.lru_cache(maxsize=1024)
def field_reader(cls: type, adapter_names: tuple[str, ...] | None) -> FieldReader:
    """The FieldReader of a record class (`adapter_names`: the fields an adapter declares for it)."""
    if adapter_names is not None:
        names = adapter_names
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return FieldReader(tuple(cls._fields), tuple, False)
    elif dataclasses.is_dataclass(cls):
        names = tuple(f.name for f in dataclasses.fields(cls))
    elif issubclass(cls, msgspec.Struct):
        names = tuple(cls.__struct_fields__)
    else:      # pydantic: extra fields come and go, so always the encoder's listing
        return FieldReader((), None, False)
    if not names:
        return FieldReader(names, lambda obj: (), False)
    getter = operator.attrgetter(*names)
    get = getter if len(names) > 1 else (lambda obj: (getter(obj),))
    return FieldReader(names, get, adapter_names is None)



@dataclasses.dataclass(frozen=True)
class Encoder:
    """Turns Python objects into Values; anything not expressible by value becomes a ref."""

    make_ref: Callable[[object], pb.Ref]  # called for anything that cannot go by value
    tensor_max_bytes: int = 16 * 1024 * 1024  # larger tensors go as refs
    # Deeper containers: the subtree goes as a ref. Not 64: protobuf (upb) refuses to parse or copy
    # messages nested over 100 deep, and a map or record level costs 3 (Value, Map, Entry), so 32 is
    # the most that still parses inside a CallRequest, leaf enums and nulls included.
    max_depth: int = 32
    # Plain classes that adapters declare to be records (vLLM's RequestOutput is neither a dataclass
    # nor a struct), by exact type, with the attribute names to send.
    records: Mapping[type, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    # For one stream of records: fields that stay the same object from item to item (a request's prompt
    # and prompt token ids) are encoded once and copied after that. None: no memo (one-off values).
    constant_fields: Mapping[type, frozenset[str]] = dataclasses.field(default_factory=dict)
    memo: dict[tuple[type, str], tuple[Any, ...]] | None = None
    # For one stream of records: fields that hold one list which only grows (see
    # `adapters.spec.Growing`). With a memo, such a list's last encoding is copied (in C) and only
    # its new items are encoded, while it is still the same list; a patch sender compares only them.
    growing_fields: Mapping[type, frozenset[str]] = dataclasses.field(default_factory=dict)
    # The most work one `encode` may do, counted in items (a container's items, a record's fields;
    # packed ints at an eighth each, they cost that much less; tensors, text and bytes one per 128
    # bytes) before it stops with `TooCostly`.
    # None: no bound. A worker encodes every result on its one event loop, and a 100-byte request
    # can ask for megabytes: a result past the bound is encoded again when its turn comes
    # (`wire/turns.py`), so no caller's large results hold the loop that serves everyone.
    work_limit: int | None = None
    # With a work limit, also the most time one `encode` may take (what an item costs varies: a
    # tensor view costs 30 times an int).
    time_limit_s: float | None = None
    _work: list[float] = dataclasses.field(default_factory=lambda: [0, math.inf], repr=False)
    # How each scalar type is put: with a work limit, text and bytes count one item per 128 bytes
    # (a copy, but every byte is copied again on its way out).
    _scalars: Mapping[type, Callable[[Any, pb.Value], None]] = dataclasses.field(init=False, repr=False)

    def __post_init__(self) -> None:
        scalars = _SCALARS
        if self.work_limit is not None:
            def by_size(put: Callable[[Any, pb.Value], None]) -> Callable[[Any, pb.Value], None]:
                def put_counted(obj: Any, out: pb.Value) -> None:
                    self._charge(len(obj) >> 7)
                    put(obj, out)
                return put_counted
            scalars = {**_SCALARS, str: by_size(_SCALARS[str]), bytes: by_size(_SCALARS[bytes])}
        object.__setattr__(self, "_scalars", scalars)

    def encode(self, obj: object) -> pb.Value:
        return self.encode_into(obj, pb.Value())

    def encode_into(self, obj: object, out: pb.Value) -> pb.Value:
        """Fills `out` (e.g. the value field of a reply being built), saving a copy of the tree."""
        put = self._scalars.get(type(obj))
        self._work[0] = 0
        if self.time_limit_s is not None:
            self._work[1] = time.perf_counter() + self.time_limit_s
        if put is not None:
            put(obj, out)
        else:
            self._fill(obj, out, 0, set())
        return out

    def _charge(self, items: int) -> None:
        assert self.work_limit is not None
        work = self._work[0] = self._work[0] + items
        if work > self.work_limit or time.perf_counter() > self._work[1]:
            raise TooCostly(int(work))

    def encode_at(self, obj: object, out: pb.Value, depth: int, active: set[int]) -> None:
        """Fills `out` with obj as the encoder fills it `depth` levels down, inside the containers
        whose ids are in `active` (its ancestors): for senders of parts of a value (the patcher),
        whose parts must encode exactly as they do inside the whole."""
        self._fill(obj, out, depth, active)

    def record_fields(self, obj: object) -> list[tuple[str, object]] | None:
        """obj's fields as the encoder sends them, in order, if obj goes as a record (else None)."""
        cls = type(obj)
        names = self.records.get(cls)
        if names is not None:
            return [(n, getattr(obj, n)) for n in names if hasattr(obj, n)]
        if _leaf_kind(cls) is not None:
            return None
        return _record_fields(obj)

    def _ref(self, obj: object, out: pb.Value) -> None:
        out.ref.CopyFrom(self.make_ref(obj))

    def _fill(self, obj: Any, out: pb.Value, depth: int, active: set[int]) -> None:
        cls = type(obj)
        put = self._scalars.get(cls)
        if put is not None:
            return put(obj, out)
        kind, fields = _CONTAINERS.get(cls), None
        if kind is None:
            names = self.records.get(cls)
            if names is not None:
                fields = [(n, getattr(obj, n)) for n in names if hasattr(obj, n)]
            elif self._fill_leaf(obj, out):
                return None
            else:
                fields = _record_fields(obj)
            kind = "record" if fields is not None else next(
                (k for t, k in _CONTAINERS.items() if isinstance(obj, t)), None)
            if kind is None:
                return self._ref(obj, out)
        ints = cls is list and obj and type(obj[0]) is int
        if self.work_limit is not None:
            self._charge(len(fields) if fields is not None else len(obj) >> 3 if ints else len(obj))
        if ints:
            if set(map(type, obj)) == _INT_ONLY:
                try:   # token ids: one packed field instead of a Value per int
                    out.ints.values.extend(obj)
                    return None
                except ValueError:   # an int past 64 bits: those go one by one, as big_int
                    out.ClearField("ints")
            if self.work_limit is not None:     # one by one after all: the rest of their cost
                self._charge(len(obj) - (len(obj) >> 3))
        # It holds other values: a deep or cyclic structure goes as a ref instead of recursing forever.
        if depth >= self.max_depth or id(obj) in active:
            return self._ref(obj, out)
        active.add(id(obj))
        depth += 1
        scalars = self._scalars
        if fields is not None:
            record = out.record
            record.type_name = _type_name_of(cls)
            constant = growing = None
            if self.memo is not None:
                constant, growing = self.constant_fields.get(cls), self.growing_fields.get(cls)
            add_field = record.fields.add
            for name, value in fields:
                field = add_field(name=name)
                put = scalars.get(type(value))  # the scalar case inlined, as for list items
                if put is not None:
                    put(value, field.value)
                elif constant and name in constant:
                    self._fill_constant(cls, name, value, field.value, depth, active)
                elif growing and name in growing:
                    self._fill_growing(cls, name, value, field.value, depth, active)
                else:
                    self._fill(value, field.value, depth, active)
        elif kind == "map":
            out.map.SetInParent()
            for key, value in obj.items():
                entry = out.map.entries.add()
                self._fill(key, entry.key, depth, active)
                self._fill(value, entry.value, depth, active)
        else:
            holder = getattr(out, kind)
            holder.SetInParent()
            self._fill_items(obj, holder.items.add, depth, active)
        active.discard(id(obj))

    def _fill_items(self, items: Any, add: Callable[[], pb.Value], depth: int, active: set[int]) -> None:
        """A list's or tuple's items, at their own depth (their container's id in `active`)."""
        scalars = self._scalars
        for item in items:
            put = scalars.get(type(item))  # the scalar case inlined: most items are scalars
            if put is not None:
                put(item, add())
            else:
                self._fill(item, add(), depth, active)

    def _fill_constant(self, cls: type, name: str, value: Any, out: pb.Value, depth: int, active: set[int]) -> None:
        assert self.memo is not None
        seen = self.memo.get((cls, name))
        if seen is not None and seen[0] is value:
            out.CopyFrom(seen[1])
            return
        self._fill(value, out, depth, active)
        self.memo[(cls, name)] = (value, out)   # keeps `value` alive, so its id cannot be reused

    def _fill_growing(self, cls: type, name: str, value: Any, out: pb.Value, depth: int, active: set[int]) -> None:
        """A field declared growing: while it is the list encoded last time, at the same depth, and no
        shorter, that encoding is copied and only the new items are encoded onto it. The kind stays
        as `_fill` would choose it: packed ints only while every item is an int of 64 bits."""
        assert self.memo is not None
        key = (cls, name)
        seen = self.memo.get(key)
        if seen is not None and seen[0] is value and seen[2] == depth and len(value) >= seen[3] > 0:
            last, n = seen[1], seen[3]
            kind = last.WhichOneof("kind")
            tail = value[n:]
            if kind == "ints" and (not tail or (set(map(type, tail)) == _INT_ONLY and
                                                _I64_MIN <= min(tail) and max(tail) <= _I64_MAX)):
                out.CopyFrom(last)
                out.ints.values.extend(tail)
                self.memo[key] = (value, out, depth, len(value))
                return
            if kind == "list" and depth < self.max_depth and id(value) not in active:
                out.CopyFrom(last)
                active.add(id(value))
                self._fill_items(tail, out.list.items.add, depth + 1, active)
                active.discard(id(value))
                self.memo[key] = (value, out, depth, len(value))
                return
        self._fill(value, out, depth, active)
        if type(value) is list:
            self.memo[key] = (value, out, depth, len(value))   # keeps `value` alive, so its id cannot be reused

    def _fill_leaf(self, obj: Any, out: pb.Value) -> bool:
        """Fill the by-value kinds that hold no other values, matched by class; False if none."""
        kind = _leaf_kind(type(obj))
        if kind is None:
            return False
        if kind == "enum":
            self._enum(obj, out)
        elif kind == "tensor":
            self._tensor(obj, out)
        elif kind == "ndarray":
            self._ndarray(obj, out)
        elif kind == "np.bool_":
            out.bool = bool(obj)
        elif kind == "np.integer":
            _put_int(int(obj), out)
        elif kind == "np.floating":  # np.float16 and np.longdouble are not float subclasses
            out.float = float(obj)
        else:  # a subclass of a scalar type: kind is that type's name
            _SCALARS[_SCALAR_BASES[kind]](obj, out)
        return True

    def _enum(self, member: enum.Enum, out: pb.Value) -> None:
        out.enum.type_name = _type_name_of(type(member))
        out.enum.name = member.name or ""
        # The value is informative only: send plain scalars, never mint a ref just to describe it.
        put = _SCALARS.get(type(member.value))
        if put is not None:
            put(member.value, out.enum.value)

    def _tensor(self, t: torch.Tensor, out: pb.Value) -> None:
        if (t.layout != torch.strided or t.is_quantized or t.is_nested or t.device.type == "meta"
                or t.nbytes > self.tensor_max_bytes):
            return self._ref(t, out)
        if self.work_limit is not None:
            self._charge(1 + (t.nbytes >> 7))    # its bytes are copied four times on their way out
        t = t.detach().cpu().resolve_conj().resolve_neg()  # lazy conj/neg bits are not in the bytes
        out.tensor.dtype = str(t.dtype).removeprefix("torch.")
        out.tensor.shape.extend(t.shape)
        if t.numel():  # a byte view, not numpy: numpy has no bfloat16 or float8
            out.tensor.data = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()

    def _ndarray(self, a: np.ndarray, out: pb.Value) -> None:
        if a.dtype.name not in _NUMPY_DTYPES or a.nbytes > self.tensor_max_bytes or np.ma.isMaskedArray(a):
            return self._ref(a, out)
        if self.work_limit is not None:
            self._charge(1 + (a.nbytes >> 7))
        out.tensor.dtype = a.dtype.name
        out.tensor.shape.extend(a.shape)
        out.tensor.data = np.ascontiguousarray(a, dtype=a.dtype.newbyteorder("<")).tobytes()
