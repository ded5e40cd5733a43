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
import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

import grpc
from google.protobuf.message import DecodeError

from bridge_server.wire.errors import BridgeError, server_error, target_label
from bridge_server.wire.eventloop import never_ran
from bridge_server.wire.options import RuntimeOptions, parse_metadata, time_left_s
from bridge_server.wire.protocol import (
    LARGE_REQUEST_BYTES,
    MAX_MESSAGE_BYTES,
    MUX_BATCH_SLICE,
    LargeRequest,
    batch_within_limit,
    call_within_limit,
    in_slices,
    large_batch_within_limit,
    mux_calls_named,
    mux_refusal,
    parse_request,
    start_options_within_limit,
    stop_reading,
    too_large,
)
from bridge_server.worker.deadlines import resolve_deadlines, with_deadline
from bridge_server.worker.invoke import Caller, Invoker
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["MuxSession", "Outbox", "multiplex"]

MAX_PENDING = 4096   # events gathered for the next reply before every producer waits
MAX_REPLY_BYTES = MAX_MESSAGE_BYTES   # one reply message (gRPC's limit; the lane's frames allow a little more)
PER_CALL = 2         # events of one call gathered before that call waits
SMALL_CALL_BYTES = 16 << 10   # in a large message, a call this small is parsed where it is read


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
    dropped: set[int] = field(default_factory=set)                 # calls ended for a result over the limit
    max_bytes: int = MAX_REPLY_BYTES                                # one reply message at most
    said: set[str] = field(default_factory=set)                    # refusals under id 0 in `reply`

    def has_room(self, call_id: int) -> bool:
        return (self.pending.get(call_id, 0) < self.per_call and len(self.reply.events) < self.max_pending
                and self.credit.get(call_id, 1) > 0)

    async def wait_for_room(self, call_id: int) -> None:
        while not self.has_room(call_id):
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
        """A new event, already in the reply: the caller fills it before its next await (for a call
        already ended for a result over the limit, a detached event that goes nowhere)."""
        if call_id in self.dropped:
            return pb.MuxEvent(id=call_id)
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
        self.said.clear()
        self.ready.clear()
        self.room.set()
        return reply

    def frames(self, reply: pb.MuxReply, running: Mapping[int, asyncio.Task[None]]) -> list[bytes]:
        """The reply as serialized messages, each within the message limit. Serializing is all it
        costs in the common case; a reply over the limit is split, and an event that alone is over it
        (a result too large to send) ends its call with RESOURCE_EXHAUSTED instead, so one oversized
        result never takes down the stream or lane that every other call shares."""
        data: bytes = reply.SerializeToString()
        limit = self.max_bytes
        if len(data) <= limit:
            return [data]
        # Each event is serialized once and the frames are put together from those bytes (a reply is
        # its events' fields in a row): measuring the growing frame for each event was quadratic, and
        # 30 results of 9 MB held the loop 13 s.
        head = pb.MuxReply(worker_refs=reply.worker_refs).SerializeToString()
        out: list[bytes] = []
        parts: list[bytes] = []
        used = len(head)
        for event in reply.events:
            if event.id in self.dropped:
                continue
            data = event.SerializeToString()
            if len(data) > limit - 1024:
                self.dropped.add(event.id)
                task = running.get(event.id)
                if task is not None:
                    task.cancel()
                data = pb.MuxEvent(id=event.id, error=BridgeError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "worker",
                    f"the result of call {event.id} is {len(data):,} bytes, over the limit of {limit:,} bytes for "
                    f"one message: return it as a ref, or in parts", reason="result too large").to_mux_error(),
                ).SerializeToString()
            piece = _EVENTS_TAG + _varint(len(data)) + data
            if parts and used + len(piece) > limit:
                out.append(head + b"".join(parts))
                parts, used = [], len(head)
            parts.append(piece)
            used += len(piece)
        if parts:
            out.append(head + b"".join(parts))
        return out


_EVENTS_TAG = bytes([1 << 3 | 2])     # MuxReply.events: field 1, length-delimited


def _varint(n: int) -> bytes:
    out = bytearray()
    while n > 0x7F:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def caller_of(opts: RuntimeOptions, identity: str | None, peer: str = "") -> Caller:
    """Whom a call is for. `identity` None: the peer is our pool server (over the lane), which names
    the client (and its connection) and marks a Collective's share in the call's options; else the
    RPC's own caller (on connection `peer`), whose options cannot claim any of it."""
    if identity is None:
        return Caller(opts.identity, opts.session_id, opts.collective, opts.client or opts.identity,
                      opts.collective_check)
    return Caller(identity, opts.session_id, False, identity or peer)


async def _run(invoker: Invoker, start: pb.MuxStart, call: pb.CallRequest | LargeRequest,
               defaults: Sequence[tuple[str, str | bytes]], rpc_remaining: Callable[[], float | None], out: Outbox,
               identity: str | None, peer: str = "") -> None:
    """One call, start to last event. Never raises: every outcome becomes an event for its id."""
    label = target_label(call.target)
    try:
        opts = parse_metadata((*defaults, *start.metadata.items()))
        caller = caller_of(opts, identity, peer)
        plan = invoker.plan(call.target, caller)
        # the RPC's deadline and the start's own (time_left_s refuses a negative one)
        limits = [t for t in (rpc_remaining(), time_left_s(start.time_left_ms)) if t is not None]
        deadlines = resolve_deadlines(opts, min(limits) if limits else None, plan.profile)
        if not start.stream:
            value = await invoker.call(call, caller, deadlines, plan)
            await out.wait_for_room(start.id)
            out.add(start.id).value.CopyFrom(value)
            return
        items = invoker.stream(call, caller, deadlines, opts.stream_interval_s, plan, opts.stream_encoding,
                               opts.stream_tee)
        async with contextlib.aclosing(items):
            async for item, put in items:
                if not out.has_room(start.id):     # the caller reads slower than the stream goes: bounded
                    # by the stall limit, and by the call's deadline (a Multiplex call has no other)
                    await with_deadline(invoker.stall.wait(out.wait_for_room(start.id), label), deadlines.total,
                                        label, "waiting for the caller to read")
                event = out.add_item(start.id)
                try:
                    put(item, event)
                except BaseException:
                    out.drop_last()
                    raise
        out.add(start.id).end.SetInParent()
    except asyncio.CancelledError:
        if start.id in out.dropped:     # ended for a result over the limit: its error has gone already
            raise
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
                 rpc_remaining: Callable[[], float | None], out: Outbox, identity: str | None = "",
                 max_request_bytes: int = MAX_MESSAGE_BYTES, peer: str = "") -> None:
        self.invoker = invoker
        self.identity = identity            # None: the peer is our pool server (see caller_of)
        self.peer = peer                    # the RPC's connection
        self.max_request_bytes = max_request_bytes
        self.defaults = tuple(defaults)
        self.rpc_remaining = rpc_remaining
        self.out = out
        self.running: dict[int, asyncio.Task[None]] = {}
        self.refusing = ""          # set when the server stops: new calls fail with UNAVAILABLE and this reason
        self.idle = asyncio.Event()
        self.idle.set()

    def handle_bytes(self, raw: bytes) -> None:
        """Handles one request as read off the wire. Bytes that are not a `MuxRequest` end only the
        call they name (or, when no call id can be read from them, get an error event for id 0,
        which no call uses), so one bad message never takes a shared stream or lane down."""
        if len(raw) >= LARGE_REQUEST_BYTES:
            views, nested = self._views(raw)
            for view in views:
                self._handle_view(view, nested)
            return
        request = self.parse(raw)
        if request is not None:
            self.handle(request)

    async def feed(self, raw: bytes) -> None:
        """handle_bytes for a stream a stranger writes: a batch's requests are handled a slice at a
        time, with the loop free between slices, so one message of many thousand small starts
        delays other calls and connections no more than as many messages would. The next message
        is read only after the batch, so requests keep their order."""
        if len(raw) >= LARGE_REQUEST_BYTES:
            await self.invoker.turns.acquire(self.identity or self.peer)    # the connection's turn
            try:
                large_batch_within_limit(raw)      # counted before any parse: over the limit ends the stream
                views, nested = self._views(raw)
            finally:
                self.invoker.turns.release()
            batch_within_limit(len(views))
            parsed = 0
            for i, view in enumerate(views):
                if parsed >= LARGE_REQUEST_BYTES or (i and i % MUX_BATCH_SLICE == 0):
                    await asyncio.sleep(0)
                    parsed = 0
                parsed += self._handle_view(view, nested)
            return
        request = self.parse(raw)
        if request is None:
            return
        if request.WhichOneof("kind") == "batch":
            batch_within_limit(len(request.batch.requests))
            await in_slices(request.batch.requests, functools.partial(self.handle, nested=True))
        else:
            self.handle(request)

    def parse(self, raw: bytes) -> pb.MuxRequest | None:
        """The request; None when it was handled here instead (as views) or refused."""
        if len(raw) > self.max_request_bytes:
            err = too_large(len(raw), self.max_request_bytes, "Multiplex")
        else:
            try:
                return pb.MuxRequest.FromString(raw)
            except (DecodeError, RecursionError, ValueError) as exc:
                if self._as_views(raw):
                    return None
                err = BridgeError.validation(
                    f"Multiplex: a request is not a valid vllm_bridge.v1.MuxRequest ({len(raw)} bytes): {exc}",
                    parameter="request")
        for call_id in mux_calls_named(raw):
            if call_id not in self.running:     # a running call's own events go on
                self._refuse(call_id, err)
        return None

    def _as_views(self, raw: bytes) -> bool:
        """Handles a request that protobuf would not parse whole, call by call, if it can: a call
        nested near protobuf's depth limit is within it on its own, but not inside a MuxRequest (the
        pool server forwards Call's requests over the lane in one, and a Call the pool server took
        was refused as "not a valid MuxRequest", about an RPC its client never made). Says whether
        it did; a call that is bad on its own is then refused by its id, as itself."""
        try:
            view = pb.MuxRequestView.FromString(raw)
        except (DecodeError, RecursionError, ValueError):
            return False
        if view.WhichOneof("kind") == "batch":
            if len(view.batch.requests) > MUX_BATCH_SLICE:
                return False        # a large batch is read in slices, by `feed`, as views already
            for each in view.batch.requests:
                self._handle_view(each, True)
        else:
            self._handle_view(view, False)
        return True

    def _views(self, raw: bytes) -> tuple[Sequence[pb.MuxRequestView], bool]:
        """A large message's requests, read with their calls unparsed (see LARGE_REQUEST_BYTES):
        parsed whole, a message of many tiny values held the loop for seconds and grew 25 times.
        And whether they came in a batch."""
        if len(raw) > self.max_request_bytes:
            err = too_large(len(raw), self.max_request_bytes, "Multiplex")
        else:
            try:
                view = pb.MuxRequestView.FromString(raw)
            except (DecodeError, RecursionError, ValueError) as exc:
                err = BridgeError.validation(
                    f"Multiplex: a request is not a valid vllm_bridge.v1.MuxRequest ({len(raw)} bytes): {exc}",
                    parameter="request")
            else:
                if view.WhichOneof("kind") == "batch":
                    return view.batch.requests, True      # (counted before any is read: MUX_MAX_BATCH)
                return [view], False
        for call_id in mux_calls_named(raw):
            if call_id not in self.running:
                self._refuse(call_id, err)
        return [], False

    def _handle_view(self, view: pb.MuxRequestView, nested: bool) -> int:
        """handle, for one request of a large message: a start's call is parsed here when it is
        small, and otherwise in the call's turn (a `LargeRequest`). The bytes it parsed."""
        kind = view.WhichOneof("kind")
        if kind != "start":
            request = pb.MuxRequest()
            if kind == "batch":
                request.batch.SetInParent()       # only ever nested here, and refused unread
            else:
                request.MergeFromString(view.SerializeToString())   # a cancel, a credit: a few bytes
            self.handle(request, nested)
            return 0
        head = view.start
        request = pb.MuxRequest()
        start = request.start
        rpc = f"Multiplex: call {head.id}"
        call: LargeRequest | None = None
        try:
            start_options_within_limit(len(head.metadata), head.id)
            start.id, start.stream, start.window = head.id, head.stream, head.window
            start.time_left_ms = head.time_left_ms
            start.metadata.update(head.metadata)
            target = parse_request(pb.CallTargetView, head.call, rpc, shown=pb.CallRequest).target
            if self.identity is None:     # the pool server's lane: the caller knows its call by another id
                rpc = target_label(target)
            if len(head.call) < SMALL_CALL_BYTES:
                start.call.CopyFrom(parse_request(pb.CallRequest, head.call, rpc))
            else:
                call_within_limit(head.call, rpc)
                start.call.target.CopyFrom(target)
                call = LargeRequest(target, head.call, rpc)
        except BridgeError as err:
            self._refuse(head.id if head.id not in self.running else 0, err)
            return len(head.call)
        self.handle(request, nested, call)
        return len(head.call) if call is None else 0

    def handle(self, request: pb.MuxRequest, nested: bool = False, call: LargeRequest | None = None) -> None:
        kind = request.WhichOneof("kind")
        out = self.out
        if kind == "batch":
            if nested:
                self._refuse(0, mux_refusal("nested"))
                return
            for each in request.batch.requests:
                self.handle(each, nested=True)
        elif kind == "start":
            start = request.start
            if start.id == 0:
                self._refuse(0, BridgeError.validation(
                    "Multiplex: call id 0 is reserved (for errors about requests that name no call); ids start at 1",
                    parameter="start.id"))
                return
            if start.id in self.running:   # reported under id 0: an error under its id would end the running call
                self._refuse(0, BridgeError.validation(
                    f"Multiplex: call id {start.id} is still running; ids must be unique among running calls "
                    f"(this start was refused, the running call goes on)", parameter="start.id"))
                return
            if self.refusing:
                self._refuse(start.id, BridgeError(grpc.StatusCode.UNAVAILABLE, "worker", self.refusing,
                                                   reason="worker stopping"))
                return
            try:
                start_options_within_limit(len(start.metadata), start.id)
            except BridgeError as err:
                self._refuse(start.id, err)
                return
            if not start.stream and call is None and self._answer_now(start):
                return
            if start.window:
                out.credit[start.id] = start.window
            task = asyncio.create_task(_run(self.invoker, start, start.call if call is None else call, self.defaults,
                                            self.rpc_remaining, out, self.identity, self.peer))
            self.running[start.id] = task
            self.idle.clear()
            task.add_done_callback(functools.partial(self._finished, start.id))
        elif kind == "cancel":
            target = self.running.get(request.cancel)
            if target is not None:
                if never_ran(target):       # its own CANCELLED event would never be sent
                    # (the pool server's lane: its caller knows the call by another id)
                    named = f"Multiplex: call {request.cancel}: " if self.identity is not None else ""
                    self.out.add(request.cancel).error.CopyFrom(BridgeError(
                        grpc.StatusCode.CANCELLED, "cancelled", f"{named}cancelled by the client before it began",
                        reason="cancelled").to_mux_error())
                target.cancel()
        elif kind == "credit":
            out.grant(request.credit.id, request.credit.events)
        else:
            self._refuse(0, mux_refusal("kind"))

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
        if not self.invoker.immediate(plan) or start.call.ByteSize() >= LARGE_REQUEST_BYTES:
            return False      # (a large request is decoded in its turn, which only a task can wait for)
        try:
            opts = parse_metadata((*self.defaults, *start.metadata.items()))
            time_left_s(start.time_left_ms)   # checked as `_run` does; a trivial helper is never pre-empted
            value = self.invoker.call_now(start.call, caller_of(opts, self.identity, self.peer), plan)
        except Exception as exc:
            out.add(start.id).error.CopyFrom(server_error(exc, target_label(target)).to_mux_error())
            return True
        out.add(start.id).value.CopyFrom(value)
        return True

    def _refuse(self, call_id: int, err: BridgeError) -> None:
        if call_id == 0:      # about no call: said once per reply (a batch of 65,536 empty requests got 65,536)
            if err.message in self.out.said:
                return
            self.out.said.add(err.message)
        self.out.add(call_id).error.CopyFrom(err.to_mux_error())

    def _finished(self, call_id: int, task: asyncio.Task[None]) -> None:
        if self.running.get(call_id) is task:
            del self.running[call_id]
            self.out.credit.pop(call_id, None)
            self.out.dropped.discard(call_id)
            if not self.running:
                self.idle.set()
        self.out.ready.set()   # a writer may be waiting for everything to end

    def cancel_all(self) -> list[asyncio.Task[None]]:
        """Cancels every running call (their callers are gone), at once."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        return tasks

    async def close(self) -> None:
        """Cancels every running call and waits for them to settle."""
        await asyncio.gather(*self.cancel_all(), return_exceptions=True)


async def multiplex(invoker: Invoker, requests: AsyncIterator[bytes],
                    defaults: Sequence[tuple[str, str | bytes]],
                    rpc_remaining: Callable[[], float | None], identity: str | None,
                    max_request_bytes: int = MAX_MESSAGE_BYTES, peer: str = "") -> AsyncIterator[bytes]:
    """Serves one Multiplex RPC until the client has half-closed and every call has ended.
    `defaults` are the RPC's metadata, `rpc_remaining` its deadline, `identity` its caller's, on
    connection `peer`."""
    out = Outbox()
    session = MuxSession(invoker, defaults, rpc_remaining, out, identity, max_request_bytes, peer)
    refs = invoker.refs
    # Set while no reply waits for gRPC to take it. A client that does not read blocks the write
    # (flow control); the results of calls it starts meanwhile would pile up in the outbox, unbounded,
    # so while a write is blocked and more waits behind it, none of its requests are read.
    written = asyncio.Event()
    written.set()

    async def read() -> None:
        try:
            async for raw in requests:
                while not written.is_set() and out.reply.events:
                    await written.wait()
                try:
                    await session.feed(raw)
                except BridgeError as exc:   # ends the stream, without the frames that hold what was read,
                    del raw                  # nor gRPC's reader's last message
                    await stop_reading(requests)
                    raise exc.with_traceback(None) from None
                del raw     # not kept while the next is awaited (a stream may then be silent for hours)
        finally:
            out.ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await out.ready.wait()
            if out.reply.events:
                reply = out.take()
                reply.worker_refs = len(refs)
                for frame in out.frames(reply, session.running):
                    written.clear()
                    yield frame
                    written.set()
            else:
                out.ready.clear()
            if reader.done():
                reader.result()   # the stream itself failed (a malformed request only fails its call)
                if not session.running and not out.reply.events:
                    return
    finally:
        reader.cancel()
        # before any wait: gRPC may cancel this handler again while it waits here (its RPC is over),
        # and a call left running would hold its engine's seat for a caller who is gone
        session.cancel_all()
        await asyncio.gather(reader, return_exceptions=True)
        await session.close()
