"""The pool server's side of `Bridge/Multiplex`.

Each call of a client's Multiplex stream is routed on its own, as a plain call would be (its pool,
session, affinity and refs, read from the RPC's metadata overlaid with the call's), and holds a
worker slot until it ends. Calls reach their worker over one upstream Multiplex stream per worker
per client stream. Requests and replies pass through as the bytes they came in; the router parses
them only to learn which calls they start, cancel or end. A worker that dies ends its calls with
"worker crashed", as for plain calls, and the client's other calls go on.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.errors import BridgeError
from bridge_server.poolstate import PoolRouter
from bridge_server.router import Backend, Flight, Router, read_route
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["MULTIPLEX", "forward_multiplex"]

MULTIPLEX = "/vllm_bridge.v1.Bridge/Multiplex"
_REPLY_BACKLOG = 64   # replies read from workers but not yet written to the client


@dataclass(eq=False)
class _Upstream:
    """One worker's Multiplex stream, shared by the calls of one client stream routed to it."""

    pool: PoolRouter
    backend: Backend
    call: Any                     # grpc.aio StreamStreamCall, bytes in and out
    flight: Flight
    calls: dict[int, bool] = field(default_factory=dict)   # running call id -> is a stream
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)  # one write at a time
    pump: asyncio.Task[None] | None = None


def _error_reply(ids: list[int], err: BridgeError) -> bytes:
    failure = err.to_mux_error()
    return pb.MuxReply(events=[pb.MuxEvent(id=i, error=failure) for i in ids]).SerializeToString()


async def forward_multiplex(router: Router, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext,
                            forwarded: list[tuple[str, str | bytes]],
                            failure: Callable[[Backend, Flight, grpc.aio.AioRpcError | None],
                                              Awaitable[BridgeError]]) -> AsyncGenerator[bytes, None]:
    """Yields the replies of one client Multiplex stream until it half-closes and every call ends.
    `failure` says what the calls of a worker stream that broke must report, as for plain calls."""
    defaults = tuple(context.invocation_metadata() or ())
    replies: asyncio.Queue[bytes | None] = asyncio.Queue(_REPLY_BACKLOG)
    upstreams: dict[str, _Upstream] = {}     # by worker id, while their streams last
    opened: list[_Upstream] = []              # every one, for the final clean-up
    failures: list[BaseException] = []
    where: dict[int, _Upstream] = {}          # running call -> its worker's stream
    routing: dict[int, asyncio.Task[None]] = {}
    cancelled_early: set[int] = set()         # cancels that arrived while their call was being routed

    def finish(up: _Upstream, call_id: int) -> None:
        if up.calls.pop(call_id, None) is not None:
            where.pop(call_id, None)
            up.pool.release(up.backend)

    async def pump(up: _Upstream) -> None:
        """Worker replies to the client, as bytes; notes the calls they end."""
        broke: BridgeError | None = None
        try:
            while (raw := await up.call.read()) is not grpc.aio.EOF:
                for event in pb.MuxReply.FromString(raw).events:
                    if event.WhichOneof("kind") != "value" or not up.calls.get(event.id, True):
                        finish(up, event.id)
                await replies.put(raw)
        except asyncio.CancelledError:
            if not up.flight.failed:
                raise
            broke = await failure(up.backend, up.flight, None)
        except grpc.aio.AioRpcError as err:
            broke = await failure(up.backend, up.flight, err)
        finally:
            if upstreams.get(up.backend.id) is up:
                del upstreams[up.backend.id]
            up.backend.flights.discard(up.flight)
        left = list(up.calls)
        for call_id in left:
            finish(up, call_id)
        if left:
            await replies.put(_error_reply(left, broke or BridgeError(
                grpc.StatusCode.UNAVAILABLE, "worker", f"worker {up.backend.id} ended the stream early",
                reason="worker stream ended")))

    def upstream_for(pool: PoolRouter, backend: Backend) -> _Upstream:
        up = upstreams.get(backend.id)
        if up is None:
            flight = Flight()
            call = backend.stubs[MULTIPLEX](metadata=forwarded)
            flight.call = call
            backend.flights.add(flight)
            up = upstreams[backend.id] = _Upstream(pool, backend, call, flight)
            opened.append(up)
            up.pump = asyncio.create_task(pump(up))
        return up

    async def route(call_id: int, start: pb.MuxStart, raw: bytes) -> None:
        try:
            plan = read_route((*defaults, *start.metadata.items()), context.time_remaining())
            pool, backend = await router.acquire(plan)
        except BridgeError as err:
            await replies.put(_error_reply([call_id], err))
            return
        finally:
            routing.pop(call_id, None)
        up = upstream_for(pool, backend)
        up.calls[call_id] = start.stream
        where[call_id] = up
        if call_id in cancelled_early:
            cancelled_early.discard(call_id)
            finish(up, call_id)
            await replies.put(_error_reply([call_id], BridgeError(
                grpc.StatusCode.CANCELLED, "cancelled", "cancelled by the client", reason="cancelled")))
            return
        try:
            async with up.lock:
                await up.call.write(raw)
        except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
            pass   # the stream has failed: its pump reports every call on it, this one included

    async def read() -> None:
        try:
            await relay()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:   # a malformed request: the stream ends with its error
            failures.append(exc)
        await replies.put(None)

    async def relay() -> None:
        async for raw in requests:
            request = pb.MuxRequest.FromString(raw)
            kind = request.WhichOneof("kind")
            if kind == "start":
                call_id = request.start.id
                if call_id in where or call_id in routing:
                    await replies.put(_error_reply([call_id], BridgeError.validation(
                        f"Multiplex: call id {call_id} is still running; ids must be unique among running "
                        f"calls", parameter="start.id")))
                    continue
                routing[call_id] = asyncio.create_task(route(call_id, request.start, raw))
            elif kind in ("cancel", "credit"):
                call_id = request.cancel if kind == "cancel" else request.credit.id
                up = where.get(call_id)
                if up is not None:
                    async with up.lock:
                        with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                            await up.call.write(raw)
                elif kind == "cancel" and call_id in routing:
                    cancelled_early.add(call_id)
                # (credit for a call still being routed: its window was given in its start)
            else:
                raise BridgeError.validation("Multiplex: a request must hold start, cancel or credit",
                                             parameter="kind")
        # Half-closed: once every call is placed, half-close the workers' streams and drain them.
        await asyncio.gather(*routing.values(), return_exceptions=True)
        for up in list(upstreams.values()):
            async with up.lock:
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await up.call.done_writing()
        await asyncio.gather(*(up.pump for up in list(upstreams.values()) if up.pump), return_exceptions=True)

    reader = asyncio.create_task(read())
    try:
        while (raw := await replies.get()) is not None:
            yield raw
        if failures:
            raise failures[0]
    finally:
        reader.cancel()
        for task in list(routing.values()):
            task.cancel()
        for up in opened:
            up.call.cancel()
            if up.pump is not None:
                up.pump.cancel()
        await asyncio.gather(reader, *routing.values(), *(u.pump for u in opened if u.pump),
                             return_exceptions=True)
        for up in opened:
            for call_id in list(up.calls):
                finish(up, call_id)
            up.backend.flights.discard(up.flight)
