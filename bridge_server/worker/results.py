"""A call's result on its way out: encoded into the reply, with refs for what cannot go by value.

Why a module of its own: what a result costs the worker is not what its request did. Encoding runs
on the event loop that serves every call and token stream, so a result that costs more than a bound
waits for a turn (`wire/turns.py`), one larger than a turn can encode is refused, and a result
whose bytes are many is sent in a turn however cheap it was to encode. And the surface is closed
here on the way out: no ref to code the catalog does not name leaves the worker, at any depth of a
result. A stream's items go through the same encoder (`item_writer`), paced by `streams.Pace`.
"""

from __future__ import annotations

import dataclasses
import functools
import reprlib
import types
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import grpc

from bridge_server.wire.codec import Encoder, TooCostly, without_addresses
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.options import connection_of
from bridge_server.wire.turns import (
    MAX_RESULT_WORK,
    MAX_TURN_S,
    SEND_S_PER_BYTE,
    TURN_RESULT_BYTES,
    WORK_LIMIT,
    WORK_TIME_S,
    Turns,
)
from bridge_server.worker.catalog import Catalog
from bridge_server.worker.deadlines import with_deadline
from bridge_server.worker.refs import RefRegistry
from bridge_server.worker.streams import PutItem, item_writer
from vllm_bridge.v1 import bridge_pb2 as pb

if TYPE_CHECKING:
    from bridge_server.worker.invoke import Caller
    from bridge_server.worker.planner import Plan

__all__ = ["CODE_TYPES", "Results", "take_turn"]

# Code, which a ref must never point to unless the catalog names it: a module, class or function
# reached through a result would lead anywhere.
CODE_TYPES = (ModuleType, type, types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.CodeType,
              types.FrameType, types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType,
              types.ClassMethodDescriptorType, types.GetSetDescriptorType, types.MemberDescriptorType,
              functools.partial, staticmethod, classmethod, property)


async def take_turn(turns: Turns, caller: Caller, deadline: float | None, label: str, doing: str) -> None:
    """Waits, within the call's deadline, for the caller's turn (its identity, else its connection);
    the caller then `turns.release()`s it."""
    await with_deadline(turns.acquire(caller.client or caller.identity), deadline, label,
                        f"waiting for its turn to {doing}")


@dataclass
class Results:
    """Encodes one worker's results: refs go to `refs`, costly results wait for `turns`."""

    refs: RefRegistry
    catalog: Catalog
    turns: Turns
    tensor_max_bytes: int = 16 * 1024 * 1024
    expires_in: float = 0.0     # Policy.unread_request_s, for what the catalog says expires

    def encoder(self, caller: Caller, exclusive: bool, stream: bool = False,
                minted: list[str] | None = None, work_limit: int | None = None,
                time_limit_s: float | None = None, opened: list[int] | None = None) -> Encoder:
        """Values to protobuf; what cannot go by value becomes a ref the caller owns. Code that the
        catalog does not name is refused, wherever in the result it is. `opened`: the open files the
        call's object took when it was made (`Invoker.call` counts them), charged with the first ref
        minted to the object it holds (`refs.py`: each client's share of the worker's open files)."""
        code_ok = self.catalog.code_objects

        def make_ref(obj: object) -> pb.Ref:
            if isinstance(obj, CODE_TYPES) and id(obj) not in code_ok:
                raise BridgeError(grpc.StatusCode.PERMISSION_DENIED, "validation",
                                  f"the result holds a {type(obj).__name__} ({_short_repr(obj)[:80]}), which is not "
                                  f"part of the documented surface: no ref to it leaves the worker", reason="code")
            files = opened.pop() if opened else 0
            entry = self.refs.put(obj, caller.session, owner=caller.identity, exclusive=exclusive,
                                  expires_in=self.expires_in if self.catalog.expires(obj) else None,
                                  connection=connection_of(caller.client), files=files)
            if minted is not None:
                minted.append(entry.id)
            return pb.Ref(id=entry.id, session_id=caller.session, worker_id=self.refs.worker_id,
                          type_name=entry.type_name, repr=_short_repr(obj))
        return Encoder(make_ref=make_ref, tensor_max_bytes=self.tensor_max_bytes, records=self.catalog.records,
                       constant_fields=self.catalog.record_constants, memo={} if stream else None,
                       growing_fields=self.catalog.record_growing, work_limit=work_limit, time_limit_s=time_limit_s)

    def encode(self, plan: Plan, result: Any, caller: Caller, out: pb.Value | None = None,
               work_limit: int | None = None, minted: list[str] | None = None,
               time_limit_s: float | None = None, opened: list[int] | None = None) -> pb.Value:
        """The result as a Value (filled into `out` if given; the refs it mints listed in `minted`).
        Past `work_limit`: TooCostly, with nothing of the result left behind (`out` cleared, no ref
        minted)."""
        minted = [] if minted is None else minted
        enc = self.encoder(caller, plan.exclusive, minted=minted, work_limit=work_limit, time_limit_s=time_limit_s,
                           opened=opened)
        if plan.entry is not None and plan.entry.doc is not None:
            result = _as_documented(plan.entry.doc.returns, result)
        out = pb.Value() if out is None else out
        try:
            if plan.result_ref and result is not None:
                out.ref.CopyFrom(enc.make_ref(result))
                return out
            return enc.encode_into(result, out)
        except BaseException:
            self.refs.release(minted)      # nothing of a result that cannot be sent stays behind
            out.Clear()
            raise

    async def deliver(self, plan: Plan, result: Any, caller: Caller, deadline: float | None,
                      out: pb.Value | None = None, files: int = 0) -> pb.Value:
        """encode, for a call's result, which waits for its turn once it costs more than a bound:
        the loop that encodes it serves every other call and stream too. `files`: what the call's
        object opened (see `encoder`), charged once, however often the result is encoded."""
        out = pb.Value() if out is None else out
        minted: list[str] = []
        opened = [files] if files > 0 else []
        try:
            self.encode(plan, result, caller, out, WORK_LIMIT, minted, WORK_TIME_S, opened)
        except TooCostly:
            pass
        else:
            if out.ByteSize() < TURN_RESULT_BYTES:
                return out
            # Cheap to encode but not to send (each byte is copied again on its way out, on this
            # loop): it is encoded again in its turn, not held meanwhile.
            out.Clear()
            self.refs.release(minted)
        await take_turn(self.turns, caller, deadline, plan.label, "encode a large result")
        sent = 0.0
        try:
            self.encode(plan, result, caller, out, MAX_RESULT_WORK, time_limit_s=MAX_TURN_S, opened=opened)
            sent = out.ByteSize() * SEND_S_PER_BYTE
            return out
        except TooCostly:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                              f"{plan.label}: its result is too large to send by value (over {MAX_RESULT_WORK:,} "
                              f"items, or the bytes of as many, or {MAX_TURN_S:g} s to encode): one turn of the "
                              f"worker's event loop encodes it, while every other call waits; ask for it as a ref, "
                              f"or in parts", target=plan.label, reason="result too large") from None
        finally:
            self.turns.release(at_least_s=sent)

    def item_writer(self, caller: Caller, exclusive: bool, encoding: str | None) -> PutItem:
        """How a stream's items are put into the messages that carry them, in the stream's encoding."""
        return item_writer(lambda stream: self.encoder(caller, exclusive, stream), encoding)


def _as_documented(returns: str, result: Any) -> Any:
    """Gives a result the shape its document promises where vLLM's own type drifts (results that
    cross vLLM's engine IPC come back as lists even when the API returns a tuple or a set)."""
    if isinstance(result, list):
        if returns.startswith("{") and returns.endswith("}"):
            return tuple(result)
        if returns.startswith("MapSet"):
            return set(result)
    return result


class _ShortRepr(reprlib.Repr):
    """A ref's `repr`, for people to read: a few items of each container and a few levels deep.
    A record's repr is built from its fields here, because its own `repr` spells out every item of
    every field before anything can cut it short (88 ms for a DPMetadata of a million sizes, on the
    worker's loop, for each ref to it)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 60, 60
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = self.maxdeque = 6

    def repr_instance(self, obj: object, level: int) -> str:
        if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            if level <= 0:
                return f"{type(obj).__qualname__}(...)"
            shown = [f for f in dataclasses.fields(obj) if f.repr]
            parts = [f"{f.name}={self.repr1(getattr(obj, f.name, None), level - 1)}" for f in shown[:self.maxlist]]
            return f"{type(obj).__qualname__}({', '.join(parts)}{', ...' if len(shown) > self.maxlist else ''})"
        return super().repr_instance(obj, level)


_SHORT_REPR = _ShortRepr()


def _short_repr(obj: object) -> str:
    try:
        text = without_addresses(_SHORT_REPR.repr(obj))
    except Exception:
        text = f"<{type(obj).__qualname__}>"
    return text if len(text) <= 200 else text[:197] + "..."
