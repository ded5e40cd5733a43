"""The lane's framing: Bridge's Multiplex messages over a plain unix socket, each prefixed by its length.

The lane is how the pool server reaches its workers (`pool/lane.py` is its end, `worker/lane.py` the
worker's). Why not a gRPC call per forwarded call: on our machines a Python gRPC hop costs about as
much as the trivial call it forwards (C-core wake-ups and per-call set-up on both ends), so a router
that re-issues each call over gRPC doubles its latency. Between the router and a worker only
`MuxRequest`s go one way and `MuxReply`s the other, and a length-prefixed stream of those same
messages on one long-lived socket does that for a fraction of the cost.

A frame is a 4-byte little-endian length and the message. One connection carries every call the
router sends that worker. Closing it ends every call on it.
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Callable

from bridge_server.wire.protocol import MAX_MESSAGE_BYTES

__all__ = ["Framed", "LaneClosed"]

_LEN = struct.Struct("<I")
# A frame holds one message of up to gRPC's limit, plus a call's id and options around it.
MAX_FRAME_BYTES = MAX_MESSAGE_BYTES + 64 * 1024
_JOIN_BELOW = 64 * 1024     # smaller frames go out as one write (one syscall); larger ones are not copied


class LaneClosed(Exception):
    """The lane's connection ended while a call was running on it."""


class Framed(asyncio.Protocol):
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
            if size > MAX_FRAME_BYTES:
                self.close(f"a frame of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
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
        if size > MAX_FRAME_BYTES:
            raise ValueError(f"a message of {size} bytes is over the limit of {MAX_FRAME_BYTES}")
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
