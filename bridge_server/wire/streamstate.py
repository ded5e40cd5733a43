"""The receiver's side of stream patches (`STREAM_ENCODING_PATCH_V1`; the sender is `patch.py`):
each stream's latest item as a Value, replaced by whole items and changed by patches, so that every
item decodes, as any Value does, to what the full encoding would have given; and, for receivers
that decode, the latest decoded item changed the same way (`DecodedStream`).
"""

from __future__ import annotations

import itertools
from typing import Any, cast

from bridge_server.wire.codec import CodecError
from bridge_server.wire.decoder import Decoder
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["DecodedStream", "StreamState"]


class _Misfit(Exception):
    """A patch that does not fit the state (turned into a CodecError that says where)."""


def _child(node: pb.Value, step: int) -> pb.Value:
    kind = node.WhichOneof("kind")
    if kind == "record":
        fields = node.record.fields
        if step < len(fields):
            return fields[step].value
    elif kind == "list" or kind == "tuple":
        items = getattr(node, kind).items
        if step < len(items):
            return items[step]
    else:
        raise _Misfit(f"a step into a {kind}")
    raise _Misfit(f"position {step} of a {kind}")


# An op as both receivers apply it: (path, op, what it carries). The op is a `PatchOp` field's name
# (carrying its Value, text, int values or `Items`), or for a row's sets one of _ROW_SETS (carrying
# the scalar itself).
Op = tuple[tuple[int, ...], str, Any]
_ROW_SETS = {"int": "set_int", "float": "set_float", "str": "set_str"}
_ROW_KINDS = frozenset({"append_str", "append_ints", *_ROW_SETS.values()})


class StreamState:
    """The receiver's side of one stream: the latest item's Value, which each item replaces (a whole
    `value`) or changes (a `patch`). The Value returned is the state itself: decode it before the
    next item arrives.

    A stream's patches change the same few places item after item (a generation's text, token ids
    and stats), so the node at each path is remembered until a `set` above it replaces what is
    below (its children are then other objects). With patch-v2 a patch may be a row: the ops of the
    patch before it, with new values (`shape` remembers those ops' paths and kinds)."""

    __slots__ = ("value", "_nodes", "shape")

    def __init__(self) -> None:
        self.value: pb.Value | None = None
        self._nodes: dict[tuple[int, ...], pb.Value] = {}
        self.shape: list[tuple[tuple[int, ...], str]] | None = None

    def full(self, value: pb.Value) -> pb.Value:
        self.value = state = pb.Value()
        state.CopyFrom(value)       # ours: the received message is not patched in place
        self._nodes.clear()
        return state

    def ops(self, patch: pb.StreamPatch) -> list[Op]:
        """The patch's ops, a row's spelled out; remembers their shape for a row that follows."""
        if patch.HasField("row"):
            if patch.ops:
                raise CodecError("patch", "ops or a row", "both")
            return self._row(patch.row)
        out: list[Op] = []
        shape: list[tuple[tuple[int, ...], str]] = []
        rows = True         # whether every op so far is of a kind a row carries
        for op in patch.ops:
            which = op.WhichOneof("op")
            if which is None:
                raise CodecError(f"patch.ops[{len(out)}]", "an op", "none")
            path = tuple(op.path)
            carried = getattr(op, which)
            if which == "append_ints":
                carried = carried.values
            out.append((path, which, carried))
            if rows:
                kind = _ROW_SETS.get(carried.WhichOneof("kind")) if which == "set" else which
                if kind is not None and kind in _ROW_KINDS:
                    shape.append((path, kind))
                else:
                    rows = False
        self.shape = shape if rows and shape else None
        return out

    def _row(self, row: pb.PatchRow) -> list[Op]:
        shape = self.shape
        if shape is None:
            raise CodecError("patch.row", "a row after a patch of ops that a row can follow", "a row")
        strs, ints, floats = row.strs, row.ints, row.floats
        s = i = f = 0
        out: list[Op] = []
        try:
            for path, kind in shape:
                if kind == "append_str" or kind == "set_str":
                    out.append((path, kind, strs[s]))
                    s += 1
                elif kind == "append_ints":
                    count = ints[i]
                    if not 0 <= count <= len(ints) - i - 1:
                        raise IndexError
                    out.append((path, kind, ints[i + 1:i + 1 + count]))
                    i += 1 + count
                elif kind == "set_int":
                    out.append((path, kind, ints[i]))
                    i += 1
                else:
                    out.append((path, kind, floats[f]))
                    f += 1
        except IndexError:
            raise CodecError("patch.row", f"the values of the {len(shape)} ops before it", "fewer") from None
        if (s, i, f) != (len(strs), len(ints), len(floats)):
            raise CodecError("patch.row", f"the values of the {len(shape)} ops before it", "more")
        return out

    def patch(self, patch: pb.StreamPatch) -> pb.Value:
        return self.apply(self.ops(patch))

    def apply(self, ops: list[Op]) -> pb.Value:
        state = self.value
        if state is None:
            raise CodecError("stream", "a whole value before the first patch", "a patch")
        nodes = self._nodes
        for n, (path, which, carried) in enumerate(ops):
            try:
                node = nodes.get(path)
                if node is None:
                    node = state
                    for step in path:
                        node = _child(node, step)
                    nodes[path] = node
                kind = node.WhichOneof("kind")
                if which == "append_str" and kind == "str":
                    node.str += carried
                elif which == "append_ints" and kind == "ints":
                    node.ints.values.extend(carried)
                elif which == "set" or which in _SETS:
                    if which == "set":
                        node.CopyFrom(carried)
                    else:
                        node.Clear()
                        setattr(node, _SETS[which], carried)
                    size = len(path)
                    for key in [k for k in nodes if len(k) > size and k[:size] == path]:
                        del nodes[key]
                elif which == "append_items" and (kind == "list" or kind == "tuple"):
                    getattr(node, kind).items.extend(carried.items)
                else:
                    raise _Misfit(f"{which} on a {kind}")
            except _Misfit as exc:
                raise CodecError(f"patch.ops[{n}] (path {list(path)})", "an op that fits the state",
                                 str(exc)) from None
        return state

    def item(self, msg: Any) -> pb.Value:
        """The Value of a `StreamItem` or `MuxEvent` that holds a stream's next item."""
        if msg.HasField("patch"):
            return self.patch(msg.patch)
        return self.full(msg.value)


_SETS = {v: k for k, v in _ROW_SETS.items()}     # a row's set: the Value field it sets


class _Whole(Exception):
    """An op that the decoded item cannot follow by itself: decode the whole state instead."""


class DecodedStream:
    """A stream's items as Python objects, for a receiver that decodes them (the Python client).

    Why: decoding each item's whole state costs in proportion to its size, and a CUMULATIVE
    generation's items grow with it (token ids, text, a logprob dict per token): a long stream
    would cost its receiver time quadratic in its length. So a patch is applied to the last decoded
    item as well, copy on write: the containers on each op's path are copied (a record is a dict
    here, a list a list), and only what the op carries is decoded. An item is therefore a new
    object whose unchanged parts are the previous item's very objects, as in vLLM's own outputs.
    What the decoded item cannot follow (a step into anything but a dict or a list, an op that
    does not fit) is decoded from the whole state, which `StreamState` has checked and applied.
    """

    __slots__ = ("state", "decoder", "last")

    def __init__(self, decoder: Decoder) -> None:
        self.state = StreamState()
        self.decoder = decoder
        self.last: Any = None

    def item(self, msg: Any) -> Any:
        """The decoded value of a `StreamItem` or `MuxEvent` that holds a stream's next item."""
        last, self.last = self.last, None      # none to build on if decoding fails
        if not msg.HasField("patch"):
            self.last = self.decoder.decode(self.state.full(msg.value))
            return self.last
        ops = self.state.ops(msg.patch)
        value = self.state.apply(ops)           # refuses what does not fit, as for any receiver
        try:
            self.last = self._apply(last, ops)
        except _Whole:
            self.last = self.decoder.decode(value)
        return self.last

    def _apply(self, root: Any, ops: list[Op]) -> Any:
        fresh: set[int] = set()          # the containers copied for this item: written in place

        def own(obj: Any) -> Any:
            cls = type(obj)
            if cls is not dict and cls is not list:
                raise _Whole
            if id(obj) in fresh:
                return obj
            copy = dict(obj) if cls is dict else list(obj)
            fresh.add(id(copy))
            return copy

        for path, which, carried in ops:
            if not path:
                root = self._op(which, carried, root)
                continue
            root = node = own(root)
            for depth, step in enumerate(path):
                key = _key(node, step)
                if depth == len(path) - 1:
                    node[key] = self._op(which, carried, node[key])
                else:
                    node[key] = child = own(node[key])
                    node = child
        return root

    def _op(self, which: str, carried: Any, old: Any) -> Any:
        """What the place that held `old` holds after the op: new objects, never `old` changed."""
        if which == "set":
            return self.decoder.decode(carried)
        if which in _SETS:          # a row's int, float or str: decoded as such a Value is
            return self.decoder.decode(pb.Value(**{_SETS[which]: carried}))
        if which == "append_str" and type(old) is str:
            return old + carried
        if which == "append_ints" and type(old) is list:
            return old + list(carried)
        if which == "append_items" and type(old) in (list, tuple):
            added = cast(list[Any], self.decoder.decode(pb.Value(list=carried)))
            return old + (added if type(old) is list else tuple(added))
        raise _Whole


def _key(node: Any, step: int) -> Any:
    """The key of a decoded record's field (by position: a record decodes to a dict of its fields
    in order) or a list's index."""
    if type(node) is dict:
        if step >= len(node):
            raise _Whole
        return next(itertools.islice(node, step, None))
    if step >= len(node):
        raise _Whole
    return step
