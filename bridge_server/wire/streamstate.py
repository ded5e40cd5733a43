"""The receiver's side of stream patches (`STREAM_ENCODING_PATCH_V1`; the sender is `patch.py`):
each stream's latest item as a Value, replaced by whole items and changed by patches, so that every
item decodes, as any Value does, to what the full encoding would have given.
"""

from __future__ import annotations

from typing import Any

from bridge_server.wire.codec import CodecError
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["StreamState"]


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
