"""Stream items as patches (`STREAM_ENCODING_PATCH_V1` in the .proto): the sender's diff and the
receiver's apply.

Why: a generation streams one `RequestOutput` per token, a record of ~30 fields of which a token or
two change (the text and token ids grow, a few timestamps move, `finished` flips once). Encoding the
whole record for every item was most of what the worker spent per streamed token. Here each item
after the first carries only what changed since the item before it: ops that set a Value, or append
to a string, a packed int list or a list, at a path of field and item positions.

The receiver (`StreamState`) keeps the latest item's Value and applies each patch to it, so what it
decodes is exactly the Value the full encoding would have sent for that item: the sender's diff
(`Patcher`) mirrors every choice the `Encoder` makes (kinds, field order, packed ints, refs for what
is too deep or cyclic) and sends a whole Value wherever it cannot show that a part stays as it was.

The sender compares each item with a *shadow* of the previous one: a private copy of what it was
encoded from (strings and numbers as they were, int lists copied, records and lists as shadows of
their parts). Identity is never taken for sameness of anything mutable: vLLM appends to a request's
token id and logprob lists in place and reuses its stats object, so an item's lists may be the very
objects of the item before, changed since.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import operator
from collections.abc import Callable
from typing import Any

import msgspec

from bridge_server.wire.codec import CodecError, Encoder
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Patcher", "StreamState"]

_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_INT_ONLY = {int}
_EXACT_SCALARS = (type(None), bool, int, bytes)


# --- the sender -----------------------------------------------------------------------------------
# One shadow class per way the encoder encodes a thing. `diff` emits the ops that turn the previous
# encoding into obj's and returns obj's shadow (itself, updated in place, where it can); `same` says
# whether obj would encode exactly as the shadowed object did. `leaf` is the object itself for the
# immutable kinds (numbers, strings, bytes, None, enum members), whose encoding cannot change while
# they stay the same object, and a private sentinel for every other kind: the hot loops skip a field
# that `is` its leaf without a call.

_NOT_A_LEAF = object()


class _Node:
    __slots__ = ()
    leaf: Any = _NOT_A_LEAF

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return False

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        if self.same(p, obj, depth, active):
            return self
        return p.whole(obj, path, depth, active)


class _Opaque(_Node):
    """Encoded as something never compared (a ref, a tensor, a set, a container subclass, a value
    past the depth limit): sent whole every time, as the full encoding would (refs included)."""

    __slots__ = ()


_OPAQUE = _Opaque()


class _Scalar(_Node):
    """None, bool, int or bytes (exact types: a bool is not the int 1, nor a str subclass a str)."""

    __slots__ = ("leaf",)

    def __init__(self, value: Any) -> None:
        self.leaf = value

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        v = self.leaf
        return obj is v or (type(obj) is type(v) and obj == v)


class _Float(_Node):
    __slots__ = ("leaf",)

    def __init__(self, value: float) -> None:
        self.leaf = value

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        v = self.leaf
        # -0.0 == 0.0 but encodes differently; a NaN is never equal, so it is re-sent (correct, rare).
        return obj is v or (type(obj) is float and obj == v and
                            (v != 0.0 or math.copysign(1.0, obj) == math.copysign(1.0, v)))


class _Str(_Node):
    __slots__ = ("leaf",)

    def __init__(self, value: str) -> None:
        self.leaf = value

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return obj is self.leaf or (type(obj) is str and obj == self.leaf)

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        v = self.leaf
        if obj is v:
            return self
        if type(obj) is str and len(obj) >= len(v) and obj.startswith(v):
            if len(obj) > len(v):
                p.op(path).append_str = obj[len(v):]
                self.leaf = obj
            return self
        return p.whole(obj, path, depth, active)


class _Enum(_Node):
    """An enum member: members are singletons, and their encoding depends on nothing else."""

    __slots__ = ("leaf",)

    def __init__(self, member: Any) -> None:
        self.leaf = member

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return obj is self.leaf


def _as_ints(obj: Any) -> bool:
    """Whether the encoder sends this (exact) list as packed `ints`: non-empty, every item an exact
    int, all within 64 bits (a bigger one makes it a list of Values)."""
    return bool(obj) and type(obj[0]) is int and set(map(type, obj)) == _INT_ONLY and \
        _I64_MIN <= min(obj) and max(obj) <= _I64_MAX


class _Ints(_Node):
    """A list sent as packed `ints`; the shadow is a copy of its values (the list itself may be
    appended to in place by its owner)."""

    __slots__ = ("values",)

    def __init__(self, values: list[int]) -> None:
        self.values = values

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        return type(obj) is list and obj == self.values and set(map(type, obj)) == _INT_ONLY

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        old = self.values
        n = len(old)
        # Every item's type, not only the new ones': an equal int of another type (True, 1.0) in
        # place of an old one would encode differently. In C, and what the encoder checks anyway.
        if type(obj) is list and len(obj) >= n and set(map(type, obj)) == _INT_ONLY and obj[:n] == old:
            if len(obj) == n:
                return self
            tail = obj[n:]
            if _I64_MIN <= min(tail) and max(tail) <= _I64_MAX:
                p.op(path).append_ints.values.extend(tail)
                old.extend(tail)
                return self
        return p.whole(obj, path, depth, active)


class _Seq(_Node):
    """A list (of values, not packed) or a tuple: its items' shadows in order."""

    __slots__ = ("cls", "items")

    def __init__(self, cls: type, items: list[_Node]) -> None:
        self.cls = cls
        self.items = items

    def _fits(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        """obj encodes as this kind (not packed ints, not a ref) and can be compared item by item."""
        cls = self.cls
        return depth < p.max_depth and id(obj) not in active and type(obj) is cls and not (
            cls is list and _as_ints(obj))

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        items = self.items
        if not self._fits(p, obj, depth, active) or len(obj) != len(items):
            return False
        active.add(id(obj))
        try:
            return all(x is node.leaf or node.same(p, x, depth + 1, active) for node, x in zip(items, obj))
        finally:
            active.discard(id(obj))

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        items = self.items
        n = len(items)
        if not self._fits(p, obj, depth, active) or len(obj) < n:
            return p.whole(obj, path, depth, active)
        active.add(id(obj))
        depth += 1
        for i in range(n):
            node, x = items[i], obj[i]
            if x is not node.leaf:
                path.append(i)
                items[i] = node.diff(p, x, path, depth, active)
                path.pop()
        if len(obj) > n:
            added = p.op(path).append_items.items
            for x in obj[n:]:
                p.fill(x, added.add(), depth, active)
                items.append(p.shadow(x, depth, active))
        active.discard(id(obj))
        return self


class _Map(_Node):
    """A dict: its entries' shadows in order. Changed maps are sent whole (no op walks into a map)."""

    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[_Node, _Node]]) -> None:
        self.entries = entries

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        entries = self.entries
        if type(obj) is not dict or len(obj) != len(entries) or depth >= p.max_depth or id(obj) in active:
            return False
        active.add(id(obj))
        depth += 1
        try:
            return all((key is k.leaf or k.same(p, key, depth, active)) and
                       (value is v.leaf or v.same(p, value, depth, active))
                       for (k, v), (key, value) in zip(entries, obj.items()))
        finally:
            active.discard(id(obj))


class _Fields:
    """How to read a record class's fields fast, worked out once per class: every field name in
    order, and a C getter of all their values at once. It applies to an object that has every field
    (none missing or msgspec UNSET), which is the usual case; for any other the encoder's own listing
    decides (`Patcher.record_fields`)."""

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
        if self.check_unset and any(map(operator.is_, values, itertools.repeat(msgspec.UNSET))):
            return None
        return values


@functools.lru_cache(maxsize=1024)
def _fields_of(cls: type, adapter_names: tuple[str, ...] | None) -> _Fields:
    if adapter_names is not None:
        names = adapter_names
    elif issubclass(cls, tuple) and hasattr(cls, "_fields"):
        return _Fields(tuple(cls._fields), tuple, False)
    elif dataclasses.is_dataclass(cls):
        names = tuple(f.name for f in dataclasses.fields(cls))
    elif issubclass(cls, msgspec.Struct):
        names = tuple(cls.__struct_fields__)
    else:      # pydantic: extra fields come and go, so always the encoder's listing
        return _Fields((), None, False)
    if not names:
        return _Fields(names, lambda obj: (), False)
    getter = operator.attrgetter(*names)
    get = getter if len(names) > 1 else (lambda obj: (getter(obj),))
    return _Fields(names, get, adapter_names is None)


class _Record(_Node):
    """A record: its class, its field names as encoded, and their values' shadows."""

    __slots__ = ("cls", "names", "values", "plan")

    def __init__(self, cls: type, names: tuple[str, ...], values: list[_Node], plan: _Fields) -> None:
        self.cls = cls
        self.names = names
        self.values = values
        self.plan = plan

    def _fields(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> Any:
        """obj's field values, if obj encodes as a record with the same fields in the same order."""
        if type(obj) is not self.cls or depth >= p.max_depth or id(obj) in active:
            return None
        plan = self.plan
        if self.names is plan.names:      # the last item had every field: the fast way, if it still has
            values = plan.values(obj)
            if values is not None:
                return values
        fields = p.record_fields(obj)
        names = self.names
        if fields is None or len(fields) != len(names):
            return None
        for (name, _), known in zip(fields, names):
            if name != known:
                return None
        return [v for _, v in fields]

    def same(self, p: Patcher, obj: Any, depth: int, active: set[int]) -> bool:
        values = self._fields(p, obj, depth, active)
        if values is None:
            return False
        active.add(id(obj))
        try:
            return all(x is node.leaf or node.same(p, x, depth + 1, active) for node, x in zip(self.values, values))
        finally:
            active.discard(id(obj))

    def diff(self, p: Patcher, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        values = self._fields(p, obj, depth, active)
        if values is None:
            return p.whole(obj, path, depth, active)
        active.add(id(obj))
        depth += 1
        nodes = self.values
        i = 0
        for x in values:
            node = nodes[i]
            if x is not node.leaf:
                path.append(i)
                nodes[i] = node.diff(p, x, path, depth, active)
                path.pop()
            i += 1
        active.discard(id(obj))
        return self


class Patcher:
    """The sender's side of one stream: puts each item into a message (a `StreamItem` or a
    `MuxEvent`, both of which have `value` and `patch`) as a whole Value the first time and as a
    patch against the previous item after that."""

    __slots__ = ("encoder", "max_depth", "root", "_ops")

    def __init__(self, encoder: Encoder) -> None:
        self.encoder = encoder
        self.max_depth = encoder.max_depth
        self.root: _Node | None = None
        self._ops: Any = None

    def put(self, obj: object, msg: Any) -> None:
        root = self.root
        # Patches pay off for what has parts that stay (records, lists, strings); a number, a map or
        # a ref is simply sent again.
        if root is None or not isinstance(root, _PATCHED_ROOTS):
            self.encoder.encode_into(obj, msg.value)
            self.root = self.shadow(obj, 0, set())
            return
        patch = msg.patch
        patch.SetInParent()            # present even when nothing changed
        self._ops = patch.ops
        try:
            self.root = root.diff(self, obj, [], 0, set())
        except BaseException:
            self.root = None           # the shadow may be half updated: never patch against it again
            raise
        finally:
            self._ops = None

    # -- what the shadows call ------------------------------------------------------------------
    def op(self, path: list[int]) -> Any:
        """A new op at `path`, for the caller to fill."""
        op = self._ops.add()
        if path:
            op.path.extend(path)
        return op

    def whole(self, obj: Any, path: list[int], depth: int, active: set[int]) -> _Node:
        """Sends obj whole at `path`, encoded exactly as the encoder would there."""
        self.fill(obj, self.op(path).set, depth, active)
        return self.shadow(obj, depth, active)

    def fill(self, obj: Any, out: pb.Value, depth: int, active: set[int]) -> None:
        self.encoder.encode_at(obj, out, depth, active)

    def record_fields(self, obj: Any) -> list[tuple[str, Any]] | None:
        return self.encoder.record_fields(obj)

    def shadow(self, obj: Any, depth: int, active: set[int]) -> _Node:
        """What obj was encoded as, to compare the next item with: mirrors `Encoder._fill`."""
        cls = type(obj)
        if cls is str:
            return _Str(obj)
        if cls is float:
            return _Float(obj)
        if cls in _EXACT_SCALARS:
            return _Scalar(obj)
        if cls is list:
            if _as_ints(obj):      # packed before any depth check, as the encoder does
                return _Ints(list(obj))
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            return _Seq(list, self._shadows(obj, obj, depth, active))
        if cls is tuple:
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            return _Seq(tuple, self._shadows(obj, obj, depth, active))
        if cls is dict:
            if depth >= self.max_depth or id(obj) in active:
                return _OPAQUE
            active.add(id(obj))
            entries = [(self.shadow(k, depth + 1, active), self.shadow(v, depth + 1, active)) for k, v in obj.items()]
            active.discard(id(obj))
            return _Map(entries)
        if cls in (set, frozenset, bytearray, memoryview):
            return _OPAQUE
        fields = self.record_fields(obj)
        if fields is None:
            return _Enum(obj) if issubclass(cls, enum.Enum) else _OPAQUE
        if depth >= self.max_depth or id(obj) in active:
            return _OPAQUE
        plan = _fields_of(cls, self.encoder.records.get(cls))  # type: ignore[arg-type]  # classes hash
        names = tuple(n for n, _ in fields)
        if names == plan.names:
            names = plan.names        # the same tuple: `_Record._fields` then takes the fast way
        return _Record(cls, names, self._shadows(obj, (v for _, v in fields), depth, active), plan)

    def _shadows(self, owner: Any, values: Any, depth: int, active: set[int]) -> list[_Node]:
        active.add(id(owner))
        try:
            return [self.shadow(v, depth + 1, active) for v in values]
        finally:
            active.discard(id(owner))


_PATCHED_ROOTS = (_Record, _Seq, _Ints, _Str)


# --- the receiver ---------------------------------------------------------------------------------

def _walk(state: pb.Value, path: Any, where: Callable[[], str]) -> pb.Value:
    node = state
    for step in path:
        kind = node.WhichOneof("kind")
        try:
            if kind == "record":
                node = node.record.fields[step].value
            elif kind == "list" or kind == "tuple":
                node = getattr(node, kind).items[step]
            else:
                raise CodecError(where(), "a path through records, lists and tuples", f"a step into {kind}")
        except IndexError:
            raise CodecError(where(), "a path within the state", f"position {step} of a {kind}") from None
    return node


class StreamState:
    """The receiver's side of one stream: the latest item's Value, which each item replaces (a whole
    `value`) or changes (a `patch`). The Value returned is the state itself: decode it before the
    next item arrives."""

    __slots__ = ("value",)

    def __init__(self) -> None:
        self.value: pb.Value | None = None

    def full(self, value: pb.Value) -> pb.Value:
        self.value = state = pb.Value()
        state.CopyFrom(value)       # ours: the received message is not patched in place
        return state

    def patch(self, patch: pb.StreamPatch) -> pb.Value:
        state = self.value
        if state is None:
            raise CodecError("stream", "a whole value before the first patch", "a patch")
        for n, op in enumerate(patch.ops):
            def where(n: int = n, op: Any = op) -> str:
                return f"patch.ops[{n}] (path {list(op.path)})"
            node = _walk(state, op.path, where)
            which = op.WhichOneof("op")
            kind = node.WhichOneof("kind")
            if which == "set":
                node.CopyFrom(op.set)
            elif which == "append_str" and kind == "str":
                node.str += op.append_str
            elif which == "append_ints" and kind == "ints":
                node.ints.values.extend(op.append_ints.values)
            elif which == "append_items" and (kind == "list" or kind == "tuple"):
                getattr(node, kind).items.extend(op.append_items.items)
            else:
                raise CodecError(where(), "an op that fits its target", f"{which} on a {kind}")
        return state

    def item(self, msg: Any) -> pb.Value:
        """The Value of a `StreamItem` or `MuxEvent` that holds a stream's next item."""
        if msg.HasField("patch"):
            return self.patch(msg.patch)
        return self.full(msg.value)
