"""The pool server's end of a worker's lane (`wire/framing.py`): Bridge's Multiplex messages over a
plain unix socket, one connection for every call the router sends that worker.

Closing the connection ends every call on it: the router's calls raise `LaneClosed` (the forwarder
turns that into "worker crashed" when the worker died).

Each windowed stream's items are counted against the credit the router gave back, so the pool can
tell which streams wait on their caller (`Lane.stalled`): a worker holding a whole window of items
that nobody credited is idle for the caller's sake, and its slot is what a queued call waits for.

The connection is one ordered stream of bytes, so whatever is written ahead of a call delays it: 30
calls of 60 MiB written at once put 1.8 GB in the pool server's write buffer, and a 6/3 sent after
them by another client waited 17-29 s. A call of LARGE_REQUEST_BYTES or more is written only when
what was written before it has gone to the worker (the transport has drained); until then it waits
in the lane, its senders' hosts taking turns, its time left counted from when it is written. A small
call is written at once, behind one large call at most.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError
from bridge_server.wire.framing import Framed, LaneClosed
from bridge_server.wire.options import CACHED_METADATA_BYTES, MD_CLIENT, MD_IDENTITY, ROUTER_ONLY_KEYS, metadata_bytes
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, host_of
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["ITEMS", "Lane", "LaneCall", "LaneClosed", "STREAM_WINDOW", "open_lane"]

STREAM_WINDOW = 32         # stream items a worker may send ahead of the router's caller (when it gave none)
ITEMS = frozenset({"value", "patch"})   # the event kinds that carry a stream's item (a whole Value or a patch)


# A `start` goes out in two encoded parts: the call itself (with the time it has left), then its
# options. A parser merges repeated occurrences of a message field, so the parts concatenated read
# as one `MuxRequest`, and the options part, which callers repeat call after call, is encoded once
# per distinct set instead of once per call.
def _options_part(metadata: tuple[tuple[str, str | bytes], ...], identity: str, client: str = "") -> bytes:
    if metadata_bytes(metadata) > CACHED_METADATA_BYTES:   # rare and large: not worth remembering
        return _encode_options(metadata, identity, client)
    return _cached_options(metadata, identity, client)


def _encode_options(metadata: tuple[tuple[str, str | bytes], ...], identity: str, client: str = "") -> bytes:
    """A call's options for the worker: its x-bridge-* metadata, but for the keys only the pool
    server may set, and the client's identity and queue key, which the worker takes from nobody else."""
    options = {k: v for k, v in metadata if k.startswith("x-bridge-") and isinstance(v, str) and k not in ROUTER_ONLY_KEYS}
    if identity:
        options[MD_IDENTITY] = identity
    if client and client != identity:
        options[MD_CLIENT] = client
    part: bytes = pb.MuxRequestView(start=pb.MuxStartView(metadata=options)).SerializeToString()
    return part


_cached_options = functools.lru_cache(maxsize=4096)(_encode_options)


class LaneCall:
    """One call on a lane: the router awaits its events in order (`next`), or has them handed to
    `on_event` as they arrive (and the connection's end to `on_lost`)."""

    __slots__ = ("id", "stream", "window", "unacked", "blocked_at", "_lane", "_events", "_waiter", "_ended",
                 "_cancelled", "_lost", "on_event", "on_lost", "on_stalled", "unsent")

    def __init__(self, lane: Lane, call_id: int, stream: bool, window: int = 0) -> None:
        self.id = call_id
        self.stream = stream
        self.window = window if stream else 0   # items the worker may send uncredited (0: no limit)
        self.unacked = 0                        # items received and not credited back
        self.blocked_at = 0.0                   # since when `unacked` fills the window (0: it does not)
        self._lane = lane
        self._events: deque[Any] = deque()      # pb.MuxEventView
        self._waiter: asyncio.Future[None] | None = None
        self._ended = False                     # the worker sent its last event, or the call was cancelled
        self._cancelled = False
        self._lost = ""
        self.on_event: Callable[[Any], None] | None = None
        self.on_lost: Callable[[str], None] | None = None
        self.on_stalled: Callable[[BridgeError], None] | None = None   # how its forwarder ends it (`stall`)
        self.unsent: _Unsent | None = None      # its start, while it waits in the lane to be written

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
        self.unacked -= events
        if self.unacked < self.window:
            self.blocked_at = 0.0
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

    def stall(self, err: BridgeError) -> None:
        """Ends the call for its stalled caller, the way its forwarder ends calls (once)."""
        hook, self.on_stalled = self.on_stalled, None
        if hook is not None and not self._ended:
            hook(err)

    def ask_to_cancel(self) -> None:
        """Asks the worker to cancel the call, and goes on listening: its last event (normally a
        CANCELLED error) still arrives (from the lane, for one the worker has not been sent)."""
        if self._ended:
            return
        if self.unsent is not None:
            self._lane.forget(self)
            self._ended = True
            self._push(pb.MuxEventView(id=self.id, error=BridgeError(
                grpc.StatusCode.CANCELLED, "cancelled", "cancelled by the client before it began",
                reason="cancelled").to_mux_error()))
            return
        self._send_cancel()

    def _send_cancel(self) -> None:
        if not self._lost and self.unsent is None:    # (one never sent is not the worker's to cancel)
            with contextlib.suppress(LaneClosed):
                self._lane.send(pb.MuxRequestView(cancel=self.id))


@dataclass(slots=True, eq=False)
class _Unsent:
    """A large call's start, waiting in the lane until what was written before it has gone."""

    lc: LaneCall
    call: bytes
    options: bytes
    deadline: float | None      # time.monotonic(); its time left is counted from when it is written
    host: str


class Lane:
    """The router's end of one worker's lane."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.framed = Framed(self._on_frame, self._on_lost)
        self.framed.on_resume = self._write_waiting
        self.calls: dict[int, LaneCall] = {}
        self.refs = -1            # the worker's live refs, as its last reply said
        self._next_id = 0
        self.on_closed: Callable[[str], None] | None = None   # after its calls have been failed
        # large starts not yet written, by their sender's host; dict order is the order of the round
        self._unsent: dict[str, deque[_Unsent]] = {}

    @property
    def closed(self) -> str:
        return self.framed.lost

    def start(self, call: bytes, metadata: Iterable[tuple[str, str | bytes]], stream: bool = False, window: int = 0,
              timeout_s: float | None = None, on_event: Callable[[Any], None] | None = None,
              on_lost: Callable[[str], None] | None = None, identity: str = "", client: str = "") -> LaneCall:
        """Starts a call (a serialized CallRequest) with Call's or Stream's semantics. `metadata` is
        the caller's (only its x-bridge-* options go on); `timeout_s` the time the call has left."""
        if self.framed.lost:
            raise LaneClosed(self.framed.lost)
        self._next_id += 1
        lc = LaneCall(self, self._next_id, stream, window)
        lc.on_event, lc.on_lost = on_event, on_lost
        options = _options_part(metadata if isinstance(metadata, tuple) else tuple(metadata or ()), identity, client)
        if len(call) >= LARGE_REQUEST_BYTES and (self._unsent or self.framed.paused):
            deadline = None if timeout_s is None else time.monotonic() + timeout_s
            lc.unsent = _Unsent(lc, call, options, deadline, host_of(client or identity))
            self._unsent.setdefault(lc.unsent.host, deque()).append(lc.unsent)
        else:
            self._write_start(lc, call, options, timeout_s)
        self.calls[lc.id] = lc
        return lc

    def _write_start(self, lc: LaneCall, call: bytes, options: bytes, timeout_s: float | None) -> None:
        head = pb.MuxRequestView(start=pb.MuxStartView(id=lc.id, call=call, stream=lc.stream, window=lc.window,
                                                       time_left_ms=0 if timeout_s is None else timeout_s * 1000))
        self.framed.send(head.SerializeToString(), options)

    def _write_waiting(self) -> None:
        """Writes the large starts that wait, one host's at a time in turn, while the transport
        takes them (called when it has drained)."""
        while self._unsent and not self.framed.paused and not self.framed.lost:
            host = next(iter(self._unsent))
            queue = self._unsent.pop(host)
            unsent = queue.popleft()
            if queue:
                self._unsent[host] = queue          # to the round's end
            unsent.lc.unsent = None
            # the time it has left now (0 on the wire means none: one that ran out gets a sliver)
            left = None if unsent.deadline is None else max(unsent.deadline - time.monotonic(), 1e-6)
            self._write_start(unsent.lc, unsent.call, unsent.options, left)

    def send(self, request: Any) -> None:
        self.framed.send(request.SerializeToString())

    async def drain(self) -> None:
        await self.framed.drain()

    def stalled(self, before: float) -> list[LaneCall]:
        """The streams whose window has been full, uncredited, since before `before` (monotonic)."""
        return [lc for lc in self.calls.values() if 0.0 < lc.blocked_at <= before and lc.on_stalled is not None]

    def forget(self, lc: LaneCall) -> None:
        if self.calls.get(lc.id) is lc:
            del self.calls[lc.id]
        unsent = lc.unsent
        if unsent is not None:          # never written: it leaves the lane's queue
            queue = self._unsent.get(unsent.host)
            if queue is not None and unsent in queue:
                queue.remove(unsent)
                if not queue:
                    del self._unsent[unsent.host]

    def _on_frame(self, frame: bytes) -> None:
        try:
            reply = pb.MuxReplyView.FromString(frame)
        except Exception as exc:   # not a worker of ours: the supervisor opens the lane again, or replaces it
            self.framed.close(f"unreadable reply from the worker: {exc}")
            return
        self.refs = reply.worker_refs
        calls = self.calls
        for event in reply.events:
            lc = calls.get(event.id)
            if lc is None:
                continue        # cancelled by the router; the worker's last word on it is moot
            if not lc.stream or event.WhichOneof("kind") not in ITEMS:
                del calls[event.id]
                lc._ended = True
            elif lc.window:
                lc.unacked += 1
                if lc.unacked >= lc.window and not lc.blocked_at:
                    lc.blocked_at = time.monotonic()
            lc._push(event)

    def _on_lost(self, reason: str) -> None:
        self._unsent.clear()
        calls, self.calls = self.calls, {}
        for lc in calls.values():
            lc._close(reason)
        if self.on_closed is not None:
            self.on_closed(reason)

    def close(self) -> None:
        self.framed.close("the lane was closed by the router")


async def open_lane(path: str) -> Lane:
    lane = Lane(path)
    await asyncio.get_running_loop().create_unix_connection(lambda: lane.framed, path)
    return lane
