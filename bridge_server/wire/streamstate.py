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


class StreamState:
    """The receiver's side of one stream: the latest item's Value, which each item replaces (a whole
    `value`) or changes (a `patch`). The Value returned is the state itself: decode it before the
    next item arrives.

    A stream's patches change the same few places item after item (a generation's text, token ids
    and stats), so the node at each path is remembered until a `set` above it replaces what is
    below (its children are then other objects)."""

    __slots__ = ("value", "_nodes")

    def __init__(self) -> None:
        self.value: pb.Value | None = None
        self._nodes: dict[tuple[int, ...], pb.Value] = {}

    def full(self, value: pb.Value) -> pb.Value:
        self.value = state = pb.Value()
        state.CopyFrom(value)       # ours: the received message is not patched in place
        self._nodes.clear()
        return state

    def patch(self, patch: pb.StreamPatch) -> pb.Value:
        state = self.value
        if state is None:
            raise CodecError("stream", "a whole value before the first patch", "a patch")
        nodes = self._nodes
        for n, op in enumerate(patch.ops):
            path = tuple(op.path)
            try:
                node = nodes.get(path)
                if node is None:
                    node = state
                    for step in path:
                        node = _child(node, step)
                    nodes[path] = node
                which = op.WhichOneof("op")
                kind = node.WhichOneof("kind")
                if which == "append_str" and kind == "str":
                    node.str += op.append_str
                elif which == "set":
                    node.CopyFrom(op.set)
                    size = len(path)
                    for key in [k for k in nodes if len(k) > size and k[:size] == path]:
                        del nodes[key]
                elif which == "append_ints" and kind == "ints":
                    node.ints.values.extend(op.append_ints.values)
                elif which == "append_items" and (kind == "list" or kind == "tuple"):
                    getattr(node, kind).items.extend(op.append_items.items)
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
        value = self.state.patch(msg.patch)     # refuses what does not fit, as for any receiver
        try:
            self.last = self._apply(last, msg.patch)
        except _Whole:
            self.last = self.decoder.decode(value)
        return self.last

    def _apply(self, root: Any, patch: pb.StreamPatch) -> Any:
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

        for op in patch.ops:
            path = op.path
            if not path:
                root = self._op(op, root)
                continue
            root = node = own(root)
            for depth, step in enumerate(path):
                key = _key(node, step)
                if depth == len(path) - 1:
                    node[key] = self._op(op, node[key])
                else:
                    node[key] = child = own(node[key])
                    node = child
        return root

    def _op(self, op: pb.PatchOp, old: Any) -> Any:
        """What the place that held `old` holds after the op: new objects, never `old` changed."""
        which = op.WhichOneof("op")
        if which == "set":
            return self.decoder.decode(op.set)
        if which == "append_str" and type(old) is str:
            return old + op.append_str
        if which == "append_ints" and type(old) is list:
            return old + list(op.append_ints.values)
        if which == "append_items" and type(old) in (list, tuple):
            added = cast(list[Any], self.decoder.decode(pb.Value(list=op.append_items)))
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
