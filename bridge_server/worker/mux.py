"""Many calls over one bidirectional stream: the worker's side of `Bridge/Multiplex`.

Why it exists: on a small machine, a gRPC call costs the Python server ~0.2 ms of CPU to set up and
every streamed message ~30 us more, on the client as well. A client running many generations at once
pays that per request and per token, on the same cores the engine needs. Over one Multiplex stream,
calls start and cancel by message, and whatever is ready at the same moment (one engine step's
output for every running request) leaves as a single reply.

Each call runs as its own task with Call's or Stream's semantics (deadlines, sessions, refs, guards,
errors), so a failure ends that call only; a call of a trivial helper (an inline plan) is answered
as its request is read, since a task would cost more than the call. Events are encoded straight
into the reply being gathered. A call with `per_call` events waiting (or any call, once the reply
holds `max_pending`) waits for the writer, which waits for gRPC's flow control: a slow reader slows
the calls instead of growing a buffer, and meanwhile vLLM merges a waiting request's outputs into
one, as it does for a slow `Stream`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError, server_error, target_label
from bridge_server.wire.protocol import parse_metadata, time_left_s
from bridge_server.worker.deadlines import resolve_deadlines
from bridge_server.worker.invoke import Invoker
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["MuxSession", "Outbox", "multiplex"]

MAX_PENDING = 4096   # events gathered for the next reply before every producer waits
PER_CALL = 2         # events of one call gathered before that call waits


@dataclass
class Outbox:
    """The reply being gathered. Events are filled in place, saving a copy per event."""

    max_pending: int = MAX_PENDING
    per_call: int = PER_CALL
    reply: pb.MuxReply = field(default_factory=pb.MuxReply)
    pending: dict[int, int] = field(default_factory=dict)          # events per call in `reply`
    credit: dict[int, int] = field(default_factory=dict)           # items a windowed stream may still send
    ready: asyncio.Event = field(default_factory=asyncio.Event)    # something to write
    room: asyncio.Event = field(default_factory=asyncio.Event)     # the writer took a reply
    on_first: Callable[[], None] | None = None                     # called when an empty reply gets an event

    async def wait_for_room(self, call_id: int) -> None:
        while (self.pending.get(call_id, 0) >= self.per_call or len(self.reply.events) >= self.max_pending
               or self.credit.get(call_id, 1) <= 0):
            self.room.clear()
            await self.room.wait()

    def grant(self, call_id: int, events: int) -> None:
        if call_id in self.credit:
            self.credit[call_id] += events
            self.room.set()

    def add_item(self, call_id: int) -> pb.MuxEvent:
        """A stream's next item: spends one credit of a windowed stream."""
        if call_id in self.credit:
            self.credit[call_id] -= 1
        return self.add(call_id)

    def add(self, call_id: int) -> pb.MuxEvent:
        """A new event, already in the reply: the caller fills it before its next await."""
        self.ready.set()
        if self.on_first is not None and not self.reply.events:
            self.on_first()
        self.pending[call_id] = self.pending.get(call_id, 0) + 1
        return self.reply.events.add(id=call_id)

    def drop_last(self) -> None:
        """Takes back the item just added (it could not be filled); nothing awaited since then."""
        last = self.reply.events[-1]
        self.pending[last.id] -= 1
        if last.id in self.credit:
            self.credit[last.id] += 1
        del self.reply.events[-1]

    def take(self) -> pb.MuxReply:
        reply, self.reply = self.reply, pb.MuxReply()
        self.pending.clear()
        self.ready.clear()
        self.room.set()
        return reply


async def _run(invoker: Invoker, start: pb.MuxStart, defaults: Sequence[tuple[str, str | bytes]],
               rpc_remaining: Callable[[], float | None], out: Outbox) -> None:
    """One call, start to last event. Never raises: every outcome becomes an event for its id."""
    label = target_label(start.call.target)
    try:
        opts = parse_metadata((*defaults, *start.metadata.items()))
        plan = invoker.plan(start.call.target)
        limits = [t for t in (opts.timeout_s, rpc_remaining(), time_left_s(start.time_left_ms)) if t is not None]
        deadlines = resolve_deadlines(opts, min(limits) if limits else None, plan.profile)
        if not start.stream:
            value = await invoker.call(start.call, opts.session_id, deadlines, plan)
            await out.wait_for_room(start.id)
            out.add(start.id).value.CopyFrom(value)
            return
        async for item, put in invoker.stream(start.call, opts.session_id, deadlines,
                                              opts.stream_interval_s, plan, opts.stream_encoding,
                                              opts.stream_tee):
            await out.wait_for_room(start.id)
            event = out.add_item(start.id)
            try:
                put(item, event)
            except BaseException:
                out.drop_last()
                raise
        out.add(start.id).end.SetInParent()
    except asyncio.CancelledError:
        out.add(start.id).error.CopyFrom(BridgeError(
            grpc.StatusCode.CANCELLED, "cancelled", f"{label}: cancelled by the client",
            target=label, reason="cancelled").to_mux_error())
        raise
    except Exception as exc:
        out.add(start.id).error.CopyFrom(server_error(exc, label).to_mux_error())


class MuxSession:
    """The running calls of one Multiplex stream (or lane connection): requests start, cancel and
    credit them synchronously, and their events gather in `out` for whoever writes replies."""

    def __init__(self, invoker: Invoker, defaults: Sequence[tuple[str, str | bytes]],
                 rpc_remaining: Callable[[], float | None], out: Outbox) -> None:
        self.invoker = invoker
        self.defaults = tuple(defaults)
        self.rpc_remaining = rpc_remaining
        self.out = out
        self.running: dict[int, asyncio.Task[None]] = {}
        self.refusing = ""          # set when the server stops: new calls fail with UNAVAILABLE and this reason
        self.idle = asyncio.Event()
        self.idle.set()

    def handle(self, request: pb.MuxRequest) -> None:
        """Raises BridgeError for a request that is none of start, cancel and credit."""
        kind = request.WhichOneof("kind")
        out = self.out
        if kind == "start":
            start = request.start
            if start.id in self.running:
                self._refuse(start.id, BridgeError.validation(
                    f"Multiplex: call id {start.id} is still running; ids must be unique among running calls",
                    parameter="start.id"))
                return
            if self.refusing:
                self._refuse(start.id, BridgeError(grpc.StatusCode.UNAVAILABLE, "worker", self.refusing,
                                                   reason="worker stopping"))
                return
            if not start.stream and self._answer_now(start):
                return
            if start.window:
                out.credit[start.id] = start.window
            task = asyncio.create_task(_run(self.invoker, start, self.defaults, self.rpc_remaining, out))
            self.running[start.id] = task
            self.idle.clear()
            task.add_done_callback(functools.partial(self._finished, start.id))
        elif kind == "cancel":
            target = self.running.get(request.cancel)
            if target is not None:
                target.cancel()
        elif kind == "credit":
            out.grant(request.credit.id, request.credit.events)
        else:
            raise BridgeError.validation("Multiplex: a request must hold start, cancel or credit", parameter="kind")

    def _answer_now(self, start: pb.MuxStart) -> bool:
        """Answers a call of a trivial helper (an inline plan) on the spot, as `_run` would, and says
        whether it did. A task and the loop turn before it runs cost more than such a call itself;
        anything else (or a full outbox, which only a task can wait on) goes to `_run`."""
        out = self.out
        target = start.call.target
        if target.kind != pb.Target.FUNCTION or len(out.reply.events) >= out.max_pending:
            return False
        try:
            plan = self.invoker.plan(target)
        except Exception:          # noqa: BLE001 - `_run` reports it, after any error in the options, as always
            return False
        if not self.invoker.immediate(plan):
            return False
        try:
            opts = parse_metadata((*self.defaults, *start.metadata.items()))
            time_left_s(start.time_left_ms)   # checked as `_run` does; a trivial helper is never pre-empted
            value = self.invoker.call_now(start.call, opts.session_id, plan)
        except Exception as exc:
            out.add(start.id).error.CopyFrom(server_error(exc, target_label(target)).to_mux_error())
            return True
        out.add(start.id).value.CopyFrom(value)
        return True

    def _refuse(self, call_id: int, err: BridgeError) -> None:
        self.out.add(call_id).error.CopyFrom(err.to_mux_error())

    def _finished(self, call_id: int, task: asyncio.Task[None]) -> None:
        if self.running.get(call_id) is task:
            del self.running[call_id]
            self.out.credit.pop(call_id, None)
            if not self.running:
                self.idle.set()
        self.out.ready.set()   # a writer may be waiting for everything to end

    async def close(self) -> None:
        """Cancels every running call (their callers are gone) and waits for them to settle."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def multiplex(invoker: Invoker, requests: AsyncIterator[pb.MuxRequest],
                    defaults: Sequence[tuple[str, str | bytes]],
                    rpc_remaining: Callable[[], float | None]) -> AsyncIterator[pb.MuxReply]:
    """Serves one Multiplex RPC until the client has half-closed and every call has ended.
    `defaults` are the RPC's metadata, `rpc_remaining` its deadline."""
    out = Outbox()
    session = MuxSession(invoker, defaults, rpc_remaining, out)
    refs = invoker.refs

    async def read() -> None:
        try:
            async for request in requests:
                session.handle(request)
        finally:
            out.ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await out.ready.wait()
            if out.reply.events:
                reply = out.take()
                reply.worker_refs = len(refs)
                yield reply
            else:
                out.ready.clear()
            if reader.done():
                reader.result()   # a malformed request ends the stream with its error
                if not session.running and not out.reply.events:
                    return
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        await session.close()
