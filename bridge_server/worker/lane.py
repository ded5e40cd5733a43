"""The worker's end of the pool server's lane (`wire/framing.py`): each connection is served as one
Multiplex stream, by the code of the worker's `Multiplex` RPC, so deadlines, sessions, refs, windows
and errors mean the same on both, and the worker's gRPC service stays a complete server on its own.
Closing a connection ends every call on it: the worker cancels them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from dataclasses import dataclass, field

from bridge_server.wire.framing import Framed
from bridge_server.wire.protocol import MAX_MESSAGE_BYTES
from bridge_server.worker.invoke import Invoker
from bridge_server.worker.mux import MuxSession, Outbox

__all__ = ["LaneServer", "serve_lane"]

log = logging.getLogger("vllm_bridge.lane")


@dataclass(eq=False)
class _Served:
    """One router connection to this worker: its calls, and the reply being gathered for it.

    Requests are handled as they are read, and whatever events the calls add during one loop turn
    leave as one reply at the end of it: no reader or writer task sits between the socket and the
    calls. Calls answered on the spot (trivial helpers) leave at the end of the read that brought
    them, without waiting for the loop turn."""

    framed: Framed
    session: MuxSession
    flushing: bool = False
    reading: bool = False       # between a read's first frame and its end, which flushes

    def on_frame(self, frame: bytes) -> None:
        self.reading = True
        try:
            self.session.handle_bytes(frame)   # a malformed request fails its call, not the lane
        except Exception as exc:   # a bug of ours: the router reopens the lane
            log.exception("lane: closing a connection after a failure handling a request")
            self.framed.close(f"the worker failed handling a request: {type(exc).__name__}: {exc}")

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
        for frame in out.frames(reply, self.session.running):
            self.framed.send(frame)


@dataclass
class LaneServer:
    """The worker's end: each connection is served as one Multiplex stream."""

    invoker: Invoker
    path: str
    max_request_bytes: int = MAX_MESSAGE_BYTES
    server: asyncio.AbstractServer | None = None
    served: set[_Served] = field(default_factory=set)

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.server = await asyncio.get_running_loop().create_unix_server(self._connection, self.path)

    def _connection(self) -> Framed:
        out = Outbox()
        framed = Framed(lambda frame: conn.on_frame(frame), lambda reason: self._lost(conn))
        conn = _Served(framed, MuxSession(self.invoker, (), lambda: None, out, identity=None,
                                          max_request_bytes=self.max_request_bytes))
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


async def serve_lane(invoker: Invoker, path: str, max_request_bytes: int = MAX_MESSAGE_BYTES) -> LaneServer:
    """Serves the pool server's lane: its peer is trusted to name the client of each call."""
    lane = LaneServer(invoker, path, max_request_bytes)
    await lane.start()
    return lane
