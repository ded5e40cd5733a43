"""The router's lane to a worker: Bridge's Multiplex messages over a plain unix socket.

Why not a gRPC call per forwarded call: on our machines a Python gRPC hop costs about as much as
the trivial call it forwards (C-core wake-ups and per-call set-up on both ends), so a router that
re-issues each call over gRPC doubles its latency. The router already terminates the caller's gRPC
call; between it and a worker it only has to move `MuxRequest`s one way and `MuxReply`s the other,
and a length-prefixed stream of those same messages on one long-lived socket does that for a
fraction of the cost. The worker serves the lane with the code of its `Multiplex` RPC, so deadlines,
sessions, refs, windows and errors mean the same on both, and its gRPC service stays a complete
server on its own for anyone else.

A frame is a 4-byte little-endian length and the message. One connection carries every call the
router sends that worker. Closing it ends every call on it: the worker cancels them, the router's
calls raise `LaneClosed` (the forwarder turns that into "worker crashed" when the worker died).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import struct
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from bridge_server.invoke import Invoker
from bridge_server.mux import MuxSession, Outbox
from bridge_server.protocol import MAX_MESSAGE_BYTES
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Lane", "LaneCall", "LaneClosed", "LaneServer", "STREAM_WINDOW", "open_lane", "serve_lane"]

log = logging.getLogger("vllm_bridge.lane")

_LEN = struct.Struct("<I")
STREAM_WINDOW = 32         # stream items a worker may send ahead of the router's caller (when it gave none)
_JOIN_BELOW = 64 * 1024     # smaller frames go out as one write (one syscall); larger ones are not copied


class LaneClosed(Exception):
    """The lane's connection ended while a call was running on it."""


class _Framed(asyncio.Protocol):
    """Frames in (to `on_frame`, in order) and out, with the transport's write flow control."""

    def __init__(self, on_frame: Callable[[bytes], None], on_lost: Callable[[str], None]) -> None:
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self._drained: asyncio.Future[None] | None = None
        self.on_resume: Callable[[], None] | None = None    # called when the peer has caught up
        self.on_batch: Callable[[], None] | None = None     # called after the frames of one read
        self.lost = ""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport    # type: ignore[assignment]  # uvloop's are Transports, not subclasses

    def data_received(self, data: bytes) -> None:
        buf = self._buf
        buf += data
        pos, end = 0, len(buf)
        while end - pos >= 4:
            (size,) = _LEN.unpack_from(buf, pos)
            if size > MAX_MESSAGE_BYTES:
                self.close(f"a frame of {size} bytes is over the limit of {MAX_MESSAGE_BYTES}")
                return
            stop = pos + 4 + size
            if stop > end:
                break
            frame = bytes(buf[pos + 4:stop])
            pos = stop
            self.on_frame(frame)
            if self.lost:
                return
        if pos:
            del buf[:pos]
            if self.on_batch is not None:
                self.on_batch()

    def send(self, *parts: bytes) -> None:
        """Sends one frame: the concatenation of `parts`."""
        if self.transport is None or self.lost:
            raise LaneClosed(self.lost or "the lane is not connected")
        size = sum(map(len, parts)) if len(parts) > 1 else len(parts[0])
        if size > MAX_MESSAGE_BYTES:
            raise ValueError(f"a message of {size} bytes is over the limit of {MAX_MESSAGE_BYTES}")
        if size < _JOIN_BELOW:
            self.transport.write(b"".join((_LEN.pack(size), *parts)))
        else:
            self.transport.writelines((_LEN.pack(size), *parts))

    @property
    def paused(self) -> bool:
        return self._drained is not None

    async def drain(self) -> None:
        """Returns once the peer has taken enough of what was sent (at once when nothing is queued)."""
        if self._drained is not None:
            await asyncio.shield(self._drained)

    def pause_writing(self) -> None:
        if self._drained is None:
            self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        waiter, self._drained = self._drained, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if self.on_resume is not None and not self.lost:
            self.on_resume()

    def close(self, reason: str) -> None:
        if self.transport is not None:
            self.transport.close()
        self.connection_lost(None, reason)

    def connection_lost(self, exc: Exception | None, reason: str = "") -> None:
        if self.lost:
            return
        self.lost = reason or (f"connection lost: {exc}" if exc else "connection closed")
        self.resume_writing()
        self.on_lost(self.lost)


# ------------------------------------------------------------------------------------ worker side
@dataclass(eq=False)
class _Served:
    """One router connection to this worker: its calls, and the reply being gathered for it.

    Requests are handled as they are read, and whatever events the calls add during one loop turn
    leave as one reply at the end of it: no reader or writer task sits between the socket and the
    calls. Calls answered on the spot (trivial helpers) leave at the end of the read that brought
    them, without waiting for the loop turn."""

    framed: _Framed
    session: MuxSession
    flushing: bool = False
    reading: bool = False       # between a read's first frame and its end, which flushes

    def on_frame(self, frame: bytes) -> None:
        self.reading = True
        try:
            self.session.handle(pb.MuxRequest.FromString(frame))
        except Exception as exc:   # a peer that sends garbage is not a router of ours
            log.error("lane: closing a connection that sent an unreadable request: %s", exc)
            self.framed.close(f"unreadable request: {exc}")

    def end_read(self) -> None:
        self.reading = False
        self.flush()

    def schedule_flush(self) -> None:
        if not self.flushing and not self.reading:
            self.flushing = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flushing = False
        out = self.session.out
        if self.framed.lost or not out.reply.events:
            return
        if self.framed.paused:
            return     # resume_writing flushes; meanwhile the calls wait for room in the outbox
        reply = out.take()
        reply.worker_refs = len(self.session.invoker.refs)
        self.framed.send(reply.SerializeToString())


@dataclass
class LaneServer:
    """The worker's end: each connection is served as one Multiplex stream."""

    invoker: Invoker
    path: str
    server: asyncio.AbstractServer | None = None
    served: set[_Served] = field(default_factory=set)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.server = await asyncio.get_running_loop().create_unix_server(self._connection, self.path)

    def _connection(self) -> _Framed:
        out = Outbox()
        framed = _Framed(lambda frame: conn.on_frame(frame), lambda reason: self._lost(conn))
        conn = _Served(framed, MuxSession(self.invoker, (), lambda: None, out))
        out.on_first = conn.schedule_flush
        framed.on_resume = conn.schedule_flush
        framed.on_batch = conn.end_read
        self.served.add(conn)
        return framed

    def _lost(self, conn: _Served) -> None:
        """The router is gone, and with it every caller of these calls."""
        self.served.discard(conn)
        asyncio.get_running_loop().create_task(conn.session.close())

    async def stop(self, grace_s: float) -> None:
        """No new connections or calls; running calls get `grace_s` to finish, then are cancelled."""
        if self.server is not None:
            self.server.close()
        served = list(self.served)
        for c in served:
            c.session.refusing = "the worker is stopping"
        if served:
            waits = [asyncio.create_task(c.session.idle.wait()) for c in served]
            _, late = await asyncio.wait(waits, timeout=grace_s)
            for t in late:
                t.cancel()
        for c in served:
            await c.session.close()
            c.flush()
            c.framed.close("the worker stopped")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


async def serve_lane(invoker: Invoker, path: str) -> LaneServer:
    lane = LaneServer(invoker, path)
    await lane.start()
    return lane


# ------------------------------------------------------------------------------------ router side
# A `start` goes out in two encoded parts: the call itself (with the time it has left), then its
# options. A parser merges repeated occurrences of a message field, so the parts concatenated read
# as one `MuxRequest`, and the options part, which callers repeat call after call, is encoded once
# per distinct set instead of once per call.
@functools.lru_cache(maxsize=4096)
def _options_part(metadata: tuple[tuple[str, str | bytes], ...]) -> bytes:
    """A call's options for the worker: its x-bridge-* metadata."""
    options = {k: v for k, v in metadata if k.startswith("x-bridge-") and isinstance(v, str)}
    part: bytes = pb.MuxRequestView(start=pb.MuxStartView(metadata=options)).SerializeToString()
    return part


class LaneCall:
    """One call on a lane: the router awaits its events in order (`next`), or has them handed to
    `on_event` as they arrive (and the connection's end to `on_lost`)."""

    __slots__ = ("id", "stream", "_lane", "_events", "_waiter", "_ended", "_cancelled", "_lost", "on_event",
                 "on_lost")

    def __init__(self, lane: Lane, call_id: int, stream: bool) -> None:
        self.id = call_id
        self.stream = stream
        self._lane = lane
        self._events: deque[Any] = deque()      # pb.MuxEventView
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False                     # the worker sent its last event, or the call was cancelled
        self._cancelled = False
        self._lost = ""
        self.on_event: Callable[[Any], None] | None = None
        self.on_lost: Callable[[str], None] | None = None

    def _push(self, event: Any) -> None:
        if self.on_event is not None:
            self.on_event(event)
            return
        self._events.append(event)
        self._wake()

    def _wake(self, cancel: bool = False) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            if cancel:
                waiter.cancel()
            else:
                waiter.set_result(None)

    def _close(self, reason: str) -> None:
        self._lost = reason
        if self.on_lost is not None:
            self.on_lost(reason)
        self._wake()

    async def next(self) -> Any:
        """The call's next `MuxEventView`; raises `LaneClosed` if the connection ended first, and
        CancelledError once `cancel` was called."""
        while not self._events or self._cancelled:
            if self._cancelled:
                raise asyncio.CancelledError
            if self._lost:
                raise LaneClosed(self._lost)
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        return self._events.popleft()

    def credit(self, events: int) -> None:
        """The consumer took `events` items of a windowed stream: the worker may send that many more."""
        if not self._ended and not self._lost:
            with contextlib.suppress(LaneClosed):
                self._lane.send(pb.MuxRequestView(credit=pb.MuxCredit(id=self.id, events=events)))

    def cancel(self) -> None:
        """Like a grpc.aio call's cancel: a pending `next` raises CancelledError, and the worker
        cancels the call (vLLM aborts its request). Nothing more arrives for it."""
        if self._ended:
            return
        self._ended = self._cancelled = True
        self._lane.forget(self)
        self._send_cancel()
        self._wake(cancel=True)

    def ask_to_cancel(self) -> None:
        """Asks the worker to cancel the call, and goes on listening: its last event (normally a
        CANCELLED error) still arrives."""
        if not self._ended:
            self._send_cancel()

    def _send_cancel(self) -> None:
        if not self._lost:
            with contextlib.suppress(LaneClosed):
                self._lane.send(pb.MuxRequestView(cancel=self.id))


class Lane:
    """The router's end of one worker's lane."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.framed = _Framed(self._on_frame, self._on_lost)
        self.calls: dict[int, LaneCall] = {}
        self.refs = -1            # the worker's live refs, as its last reply said
        self._next_id = 0

    @property
    def closed(self) -> str:
        return self.framed.lost

    def start(self, call: bytes, metadata: Iterable[tuple[str, str | bytes]], stream: bool = False, window: int = 0,
              timeout_s: float | None = None, on_event: Callable[[Any], None] | None = None,
              on_lost: Callable[[str], None] | None = None) -> LaneCall:
        """Starts a call (a serialized CallRequest) with Call's or Stream's semantics. `metadata` is
        the caller's (only its x-bridge-* options go on); `timeout_s` the time the call has left."""
        self._next_id += 1
        lc = LaneCall(self, self._next_id, stream)
        lc.on_event, lc.on_lost = on_event, on_lost
        head = pb.MuxRequestView(start=pb.MuxStartView(id=lc.id, call=call, stream=stream, window=window,
                                                       time_left_ms=0 if timeout_s is None else timeout_s * 1000))
        self.framed.send(head.SerializeToString(),
                         _options_part(metadata if isinstance(metadata, tuple) else tuple(metadata or ())))
        self.calls[lc.id] = lc
        return lc

    def send(self, request: Any) -> None:
        self.framed.send(request.SerializeToString())

    async def drain(self) -> None:
        await self.framed.drain()

    def forget(self, lc: LaneCall) -> None:
        if self.calls.get(lc.id) is lc:
            del self.calls[lc.id]

    def _on_frame(self, frame: bytes) -> None:
        try:
            reply = pb.MuxReplyView.FromString(frame)
        except Exception as exc:
            self.framed.close(f"unreadable reply from the worker: {exc}")
            return
        self.refs = reply.worker_refs
        calls = self.calls
        for event in reply.events:
            lc = calls.get(event.id)
            if lc is None:
                continue        # cancelled by the router; the worker's last word on it is moot
            if not lc.stream or event.WhichOneof("kind") != "value":
                del calls[event.id]
                lc._ended = True
            lc._push(event)

    def _on_lost(self, reason: str) -> None:
        calls, self.calls = self.calls, {}
        for lc in calls.values():
            lc._close(reason)

    def close(self) -> None:
        self.framed.close("the lane was closed by the router")


async def open_lane(path: str) -> Lane:
    lane = Lane(path)
    await asyncio.get_running_loop().create_unix_connection(lambda: lane.framed, path)
    return lane
