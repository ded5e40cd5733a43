"""Many calls over one bidirectional stream: the worker's side of `Bridge/Multiplex`.

Why it exists: on a small machine, a gRPC call costs the Python server ~0.2 ms of CPU to set up and
every streamed message ~30 us more, on the client as well. A client running many generations at once
pays that per request and per token, on the same cores the engine needs. Over one Multiplex stream,
calls start and cancel by message, and whatever is ready at the same moment (one engine step's
output for every running request) leaves as a single reply.

Each call runs as its own task with Call's or Stream's semantics (deadlines, sessions, refs, guards,
errors), so a failure ends that call only. Events are encoded straight into the reply being
gathered; when that reply holds `max_pending` events, producers wait for the writer, which waits for
gRPC's flow control: a slow reader slows the calls instead of growing a buffer.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.errors import BridgeError, server_error
from bridge_server.invoke import Invoker
from bridge_server.protocol import parse_metadata, resolve_deadlines
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Outbox", "multiplex"]

MAX_PENDING = 4096   # events gathered for the next reply before producers wait


@dataclass
class Outbox:
    """The reply being gathered. Events are filled in place, saving a copy per event."""

    max_pending: int = MAX_PENDING
    reply: pb.MuxReply = field(default_factory=pb.MuxReply)
    ready: asyncio.Event = field(default_factory=asyncio.Event)    # something to write
    room: asyncio.Event = field(default_factory=asyncio.Event)     # below max_pending

    def __post_init__(self) -> None:
        self.room.set()

    async def wait_for_room(self) -> None:
        while len(self.reply.events) >= self.max_pending:
            self.room.clear()
            await self.room.wait()

    def add(self, call_id: int) -> pb.MuxEvent:
        """A new event, already in the reply: the caller fills it before its next await."""
        self.ready.set()
        return self.reply.events.add(id=call_id)

    def take(self) -> pb.MuxReply:
        reply, self.reply = self.reply, pb.MuxReply()
        self.ready.clear()
        self.room.set()
        return reply


def _label(start: pb.MuxStart) -> str:
    return start.call.target.name or pb.Target.Kind.Name(start.call.target.kind)


async def _run(invoker: Invoker, start: pb.MuxStart, defaults: Sequence[tuple[str, str | bytes]],
               rpc_remaining: Callable[[], float | None], out: Outbox) -> None:
    """One call, start to last event. Never raises: every outcome becomes an event for its id."""
    try:
        opts = parse_metadata([*defaults, *start.metadata.items()])
        plan = invoker.plan(start.call.target)
        limits = [t for t in (opts.timeout_s, rpc_remaining()) if t is not None]
        deadlines = resolve_deadlines(opts, min(limits) if limits else None, plan.profile)
        if not start.stream:
            value = await invoker.call(start.call, opts.session_id, deadlines, plan)
            await out.wait_for_room()
            out.add(start.id).value.CopyFrom(value)
            return
        async for item, encoder in invoker.stream(start.call, opts.session_id, deadlines,
                                                  opts.stream_interval_s, plan):
            await out.wait_for_room()
            event = out.add(start.id)
            try:
                encoder.encode_into(item, event.value)
            except BaseException:
                del out.reply.events[-1]   # nothing awaited since add(): it is still the last one
                raise
        out.add(start.id).end.SetInParent()
    except asyncio.CancelledError:
        out.add(start.id).error.CopyFrom(BridgeError(
            grpc.StatusCode.CANCELLED, "cancelled", f"{_label(start)}: cancelled by the client",
            target=_label(start), reason="cancelled").to_mux_error())
        raise
    except Exception as exc:
        out.add(start.id).error.CopyFrom(server_error(exc, _label(start)).to_mux_error())


async def multiplex(invoker: Invoker, requests: AsyncIterator[pb.MuxRequest],
                    context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxReply]:
    """Serves one Multiplex stream until the client has half-closed and every call has ended."""
    out = Outbox()
    running: dict[int, asyncio.Task[None]] = {}
    defaults = tuple(context.invocation_metadata() or ())

    def refuse(call_id: int, err: BridgeError) -> None:
        out.add(call_id).error.CopyFrom(err.to_mux_error())

    def finished(call_id: int, task: asyncio.Task[None]) -> None:
        if running.get(call_id) is task:
            del running[call_id]
        out.ready.set()   # the writer checks whether everything has ended

    async def read() -> None:
        try:
            async for request in requests:
                kind = request.WhichOneof("kind")
                if kind == "start":
                    start = request.start
                    if start.id in running:
                        refuse(start.id, BridgeError.validation(
                            f"Multiplex: call id {start.id} is still running; ids must be unique among "
                            f"running calls", parameter="start.id"))
                        continue
                    task = asyncio.create_task(_run(invoker, start, defaults, context.time_remaining, out))
                    running[start.id] = task
                    task.add_done_callback(functools.partial(finished, start.id))
                elif kind == "cancel":
                    target = running.get(request.cancel)
                    if target is not None:
                        target.cancel()
                else:
                    raise BridgeError.validation("Multiplex: a request must hold start or cancel",
                                                 parameter="kind")
        finally:
            out.ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await out.ready.wait()
            if out.reply.events:
                yield out.take()
            else:
                out.ready.clear()
            if reader.done():
                reader.result()   # a malformed request ends the stream with its error
                if not running and not out.reply.events:
                    return
    finally:
        reader.cancel()
        for task in list(running.values()):
            task.cancel()
        await asyncio.gather(reader, *running.values(), return_exceptions=True)
