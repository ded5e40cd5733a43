"""The value decoder: `vllm_bridge.v1.Value` -> Python objects, the inverse of `codec.Encoder`.

Decoding is where untrusted input arrives, so every refusal is a `CodecError` naming the path of the
bad value, and records and enums are rebuilt only for types the caller allows; any other record
arrives as a plain dict of its fields.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import operator
import types
from collections.abc import Callable
from typing import Any, ClassVar

import grpc
import msgspec
import pydantic
import torch

from bridge_server.wire.codec import TORCH_DTYPES, CodecError, qualified_name, short_repr
from bridge_server.wire.errors import BridgeError
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Decoder"]


class _TooLong(Exception):
    def __init__(self, chars: int) -> None:
        self.chars = chars


_SCALAR_KINDS: dict[str | None, Callable[[pb.Value], object]] = {
    kind: operator.attrgetter(kind) for kind in ("bool", "int", "float", "str", "bytes", "atom")
}
_SCALAR_KINDS["null"] = lambda value: None


@dataclasses.dataclass(frozen=True)
class Decoder:
    """Turns Values into Python objects; records and enums are rebuilt only for allow-listed types."""

    resolve_ref: Callable[[pb.Ref], object]  # raises its own error for unknown/gone refs
    resolve_type: Callable[[str], type | None]  # allow-list of record/enum types by qualified name
    # What an enum of a type the decoder cannot rebuild becomes; None: refuse it. Clients, which do
    # not hold the server's classes, pass a function that keeps the type and member names.
    unknown_enum: Callable[[pb.Enum], object] | None = None
    # The server's check of a record's fields before its class is built (what a client may set on
    # it, and each field's type): the same check a map given for that class gets, so that a record
    # is never a way around it. Returns the fields to build with. None: build as given (clients).
    check_record: Callable[[type, dict[str, object], str], dict[str, object]] | None = None
    # The longest string a client may send (0: no limit). Text is what vLLM tokenizes, and
    # tokenizing costs time and memory in proportion: a server bounds it where it is read, for every
    # parameter alike, rather than in each function that happens to take text. The same bound holds
    # the items of a list, set or map and a packed int list: 50 million packed zeros (50 MB on the
    # wire, 400 MB as a list) kept a worker's event loop busy for 25 s checking them.
    max_str_chars: int = 0

    _KINDS: ClassVar[dict[str, Callable[[Decoder, pb.Value, str], object]]]
    _scalars: dict[str | None, Callable[[pb.Value], object]] = dataclasses.field(init=False, repr=False)
    # Items a request may still hold (`begin`): the bound is for the whole request, not each list.
    _left: list[int] = dataclasses.field(init=False, repr=False, default_factory=lambda: [0])

    def __post_init__(self) -> None:
        scalars = _SCALAR_KINDS
        if self.max_str_chars > 0:
            limit = self.max_str_chars

            def text(value: pb.Value) -> str:
                s: str = value.str
                if len(s) > limit:
                    raise _TooLong(len(s))
                return s

            scalars = {**_SCALAR_KINDS, "str": text}
        object.__setattr__(self, "_scalars", scalars)

    def decode(self, value: pb.Value, path: str = "value") -> object:
        kind = value.WhichOneof("kind")
        get = self._scalars.get(kind)
        if get is not None:
            try:
                return get(value)
            except _TooLong as exc:
                raise self._too_long(path, exc.chars) from None
        if kind is None:
            raise CodecError(path, "a Value with a kind set", "an empty Value")
        return self._KINDS[kind](self, value, path)

    def begin(self) -> None:
        """A new request: its lists, sets and maps may hold max_str_chars items in all."""
        self._left[0] = self.max_str_chars

    def _within(self, count: int, path: str, what: str) -> None:
        if self.max_str_chars <= 0:
            return
        if count > self.max_str_chars:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{path}: {what} of {count:,} items is over this server's limit of "
                              f"{self.max_str_chars:,} (max_prompt_chars)", parameter=path, reason="max_prompt_chars")
        left = self._left[0] - count
        if left < 0:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{path}: the request's lists, sets and maps hold more than {self.max_str_chars:,} "
                              f"items in all, this server's limit (max_prompt_chars)", parameter=path,
                              reason="max_prompt_chars")
        self._left[0] = left

    def _ints(self, value: pb.Value, path: str) -> list[int]:
        values = value.ints.values
        self._within(len(values), path, "a list")
        return list(values)

    def _items(self, items: Any, path: str) -> list[object]:
        self._within(len(items), path, "a collection")
        out: list[object] = []
        append, scalars = out.append, self._scalars
        i = 0
        try:
            for i, item in enumerate(items):
                get = scalars.get(item.WhichOneof("kind"))  # scalars need neither a path string nor dispatch
                append(get(item) if get is not None else self.decode(item, f"{path}[{i}]"))
        except _TooLong as exc:
            raise self._too_long(f"{path}[{i}]", exc.chars) from None
        return out

    def _too_long(self, path: str, chars: int) -> BridgeError:
        return BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                           f"{path}: a string of {chars:,} characters is over this server's limit of "
                           f"{self.max_str_chars:,} (max_prompt_chars)", parameter=path, reason="max_prompt_chars")

    def _hashables(self, items: Any, path: str, kind: str) -> list[object]:
        out = self._items(items, path)
        for i, item in enumerate(out):
            try:
                hash(item)
            except TypeError:
                raise CodecError(f"{path}[{i}]", f"a hashable {kind} element", short_repr(item)) from None
        return out

    def _big_int(self, value: pb.Value, path: str) -> int:
        text = value.big_int
        digits = text[1:] if text[:1] == "-" else text
        if not (digits.isascii() and digits.isdigit()):  # int() would also take "1_0", " 1", "+1"
            raise CodecError(path, "a base-10 integer in big_int", repr(short_repr(text)))
        try:
            return int(text)
        except ValueError as exc:  # past sys.get_int_max_str_digits()
            raise CodecError(path, "a base-10 integer in big_int", str(exc)) from None

    def _map(self, value: pb.Value, path: str) -> dict[object, object]:
        self._within(len(value.map.entries), path, "a map")
        out: dict[object, object] = {}
        for i, entry in enumerate(value.map.entries):
            key = self.decode(entry.key, f"{path}[<key #{i}>]")
            try:
                dup = key in out
            except TypeError:
                raise CodecError(f"{path}[<key #{i}>]", "a hashable map key", short_repr(key)) from None
            if dup:
                raise CodecError(f"{path}[<key #{i}>]", "distinct map keys", f"duplicate key {short_repr(key)}")
            out[key] = self.decode(entry.value, f"{path}[{short_repr(key)}]")
        return out

    def _tensor(self, value: pb.Value, path: str) -> torch.Tensor:
        msg = value.tensor
        shape, dtype = tuple(msg.shape), TORCH_DTYPES.get(msg.dtype)
        if dtype is None:
            raise CodecError(path, "a torch dtype name (e.g. 'float32')", f"dtype {msg.dtype!r}")
        if any(d < 0 for d in shape):
            raise CodecError(path, "non-negative tensor dimensions", f"shape {list(shape)}")
        if math.prod(d for d in shape if d) * dtype.itemsize >= 2**63:   # torch's sizes (empty ones too) are int64
            raise CodecError(path, "tensor dimensions whose product fits in 64 bits", f"shape {list(shape)}")
        size = math.prod(shape) * dtype.itemsize
        if len(msg.data) != size:
            expected = f"{size} bytes for {msg.dtype} of shape {list(shape)}"
            raise CodecError(path, expected, f"{len(msg.data)} bytes")
        if size == 0:
            return torch.empty(shape, dtype=dtype)
        raw = torch.frombuffer(bytearray(msg.data), dtype=torch.uint8)  # a copy: writable, and ours
        if dtype == torch.bool and int(raw.max()) > 1:
            raise CodecError(path, "bool tensor bytes of 0 or 1", "other byte values")
        return raw.view(dtype).reshape(shape)

    def _ref(self, value: pb.Value, path: str) -> object:
        """The object a ref names; a refusal of it that names no parameter is named by where it was."""
        try:
            return self.resolve_ref(value.ref)
        except BridgeError as exc:
            if not exc.parameter:
                exc.parameter = path
            raise

    def _record(self, value: pb.Value, path: str) -> object:
        rec = value.record
        self._within(len(rec.fields), path, "a record")
        fields: dict[str, object] = {}
        for field in rec.fields:
            if field.name in fields:
                raise CodecError(path, f"distinct field names in {rec.type_name}", f"{field.name!r} twice")
            fields[field.name] = self.decode(field.value, f"{path}.{field.name}")
        cls = self.resolve_type(rec.type_name)
        if cls is None:
            return fields  # not allow-listed: the fields still arrive, as a plain dict
        if self.check_record is not None:
            fields = self.check_record(cls, fields, path)   # before the class's own code sees them
        try:
            return _build(cls, fields, path)
        except CodecError:
            raise
        except Exception as exc:  # the type's own validation (TypeError, ValidationError, ...)
            got = f"{type(exc).__name__}: {exc}"
            raise CodecError(path, f"fields that {rec.type_name} accepts", got) from exc

    def _enum(self, value: pb.Value, path: str) -> object:
        msg = value.enum
        cls = self.resolve_type(msg.type_name)
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
            if self.unknown_enum is not None:
                return self.unknown_enum(msg)  # type: ignore[return-value]
            raise CodecError(path, "an allowed enum type", f"unknown enum type {msg.type_name}")
        try:
            if issubclass(cls, enum.Flag) and (msg.name == "" or "|" in msg.name):  # composite flags
                return functools.reduce(operator.or_, (cls[n] for n in msg.name.split("|") if n), cls(0))
            return cls[msg.name]
        except KeyError:
            got = f"{msg.type_name} has no member {msg.name}"
            raise CodecError(path, f"a member of {msg.type_name}", got) from None


def _build(cls: type, fields: dict[str, object], path: str) -> object:
    """Construct an allow-listed record type from decoded fields, the way that type expects."""
    if dataclasses.is_dataclass(cls):
        init = {f.name: f.init for f in dataclasses.fields(cls)}
        if unknown := [k for k in fields if k not in init]:
            raise CodecError(path, f"fields of {qualified_name(cls)}", f"unknown fields {unknown}")
        obj = cls(**{k: v for k, v in fields.items() if init[k]})
        for k, v in fields.items():
            if not init[k]:
                object.__setattr__(obj, k, v)  # not setattr: frozen dataclasses too
        return obj
    if issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return cls(**fields)
    if issubclass(cls, msgspec.Struct):  # by attribute, so renamed and array_like structs take field names
        return msgspec.convert(types.SimpleNamespace(**fields), cls, from_attributes=True)
    if issubclass(cls, pydantic.BaseModel):
        return cls.model_validate(fields, by_alias=False, by_name=True)
    raise CodecError(path, "a record type (dataclass, named tuple, msgspec Struct, pydantic model)",
                     f"{qualified_name(cls)} resolved to {cls!r}")


Decoder._KINDS = {
    "big_int": Decoder._big_int,
    "list": lambda self, value, path: self._items(value.list.items, path),
    "ints": Decoder._ints,
    "tuple": lambda self, value, path: tuple(self._items(value.tuple.items, path)),
    "set": lambda self, value, path: set(self._hashables(value.set.items, path, "set")),
    "frozenset": lambda self, value, path: frozenset(
        self._hashables(value.frozenset.items, path, "frozenset")),
    "map": Decoder._map,
    "tensor": Decoder._tensor,
    "ref": Decoder._ref,
    "record": Decoder._record,
    "enum": Decoder._enum,
}
