"""Forwarding: the router's `Bridge` service, moving request and reply bytes between caller and worker.

The service is registered as a generic handler with identity serializers, so payloads pass through
as bytes and values are never decoded. Every request is still parsed where it is read (`parse_request`):
bytes that are not the RPC's message end that call with INVALID_ARGUMENT here, and never reach a
worker's lane, which every call to that worker shares; the parsed call also names the refs it uses
(its receiver), which routing needs.
`Call`, `Stream` and `Multiplex` go to the worker over its lane (`lane.py`); the rest over the
worker's gRPC service. What crosses the hop besides the bytes: the caller's options (x-bridge-*
metadata), its deadline minus the time it waited in the queue, its cancellation, a stream's flow
control (as lane credit), and the worker's errors, rebuilt as the status the worker's own RPC gives.

A worker that dies mid-call must not leave its callers hanging: its lane closes, or the
supervisor's exit watcher fails every tracked `Flight` of that worker, and the handler turns either
into UNAVAILABLE "worker crashed".
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Sequence
from typing import Any

import grpc

from bridge_server.pool.backlog import Backlog
from bridge_server.pool.collective import run_collective
from bridge_server.pool.lane import ITEMS, STREAM_WINDOW, LaneClosed
from bridge_server.pool.metrics import Metrics
from bridge_server.pool.multiplex import forward_multiplex
from bridge_server.pool.poolstate import Backend, Flight, pool_error
from bridge_server.pool.router import Router, client_of, read_route, routed_request, session_key, time_left
from bridge_server.wire.errors import (
    STATUS_DETAILS_KEY,
    BridgeError,
    abort,
    caller_gone,
    forget_frames,
    mux_error_status,
    status_code,
    status_of,
)
from bridge_server.wire.options import MD_CLIENT, MD_IDENTITY, MD_WORKER_REFS, ROUTER_ONLY_KEYS
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, parse_request, read_release
from bridge_server.wire.security import MD_AUTHORIZATION, ServerSecurity
from bridge_server.wire.stall import StallGuard
from bridge_server.wire.turns import Turns, read_in_turn
from vllm_bridge.v1 import bridge_pb2 as pb

log = logging.getLogger("vllm_bridge.router")

SERVICE = "vllm_bridge.v1.Bridge"
CALL, RELEASE, DESCRIBE = (f"/{SERVICE}/{m}" for m in ("Call", "Release", "Describe"))
_DROP_KEYS = ("user-agent", MD_AUTHORIZATION)
# Transport-level failures of a worker's gRPC service (Release): the worker is going away.
_TRANSPORT_CODES = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
                    grpc.StatusCode.UNKNOWN)
_DEATH_WAIT_S = 0.5
_CREDIT_EVERY = STREAM_WINDOW // 2   # stream items given back to the worker at a time
COUNTED_REPLY_BYTES = 64 * 1024      # a Stream's items this large count in the backlog until read
# ... and unary replies (a Call's, a Describe's) this large: a caller may leave up to 4,096 calls of a
# connection unread (5,000 unread Describe replies of 48 KB took the pool server 168 -> 545 MB)
COUNTED_UNARY_BYTES = 16 * 1024


def make_stubs(channel: grpc.aio.Channel) -> dict[str, Any]:
    """Bytes-in, bytes-out multicallables for one worker, made once per worker, for what does not go
    over its lane (Call, Stream and Multiplex do; Collective's per-rank calls use Call here)."""
    return {CALL: channel.unary_unary(CALL), RELEASE: channel.unary_unary(RELEASE),
            DESCRIBE: channel.unary_unary(DESCRIBE)}


async def release_on(backend: Backend, request: pb.ReleaseRequest, metadata: Sequence[tuple[str, str | bytes]],
                     timeout: float | None) -> int:
    """Releases refs on one worker and notes how many it still holds, which is what a recycled
    worker's drain waits on. An empty request releases nothing and only asks for the count."""
    call = backend.stubs[RELEASE](request.SerializeToString(), metadata=metadata, timeout=timeout)
    raw = await call
    held = (await call.trailing_metadata() or grpc.aio.Metadata()).get(MD_WORKER_REFS)
    if held is not None:
        backend.refs = int(held)
    return int(pb.ReleaseReply.FromString(raw).released)


def _forwarded(metadata: Sequence[tuple[str, str | bytes]] | None, identity: str = "") -> list[tuple[str, str | bytes]]:
    """The caller's metadata as it goes on to a worker: without transport keys and credentials,
    without the keys only the pool server may set, and with the caller's identity, which the
    worker takes from no one else."""
    forwarded = [(k, v) for k, v in metadata or () if k not in _DROP_KEYS and k not in ROUTER_ONLY_KEYS
                 and not k.startswith(("grpc-", ":"))]
    if identity:
        forwarded.append((MD_IDENTITY, identity))
    return forwarded


def _has_details(err: grpc.aio.AioRpcError) -> bool:
    return any(k == STATUS_DETAILS_KEY for k, _ in err.trailing_metadata() or ())


def crashed(backend: Backend, reason: str = "") -> BridgeError:
    """The error of a call whose worker ended under it: "worker crashed", or "worker stopped" when
    the supervisor stopped it (a recycled worker that outlived its drain timeout)."""
    reason = reason or "worker crashed"
    why = f" ({backend.exit_reason})" if backend.exit_reason else ""
    verb = "was stopped" if reason == "worker stopped" else "died"
    return pool_error(grpc.StatusCode.UNAVAILABLE, f"{reason}: worker {backend.id} {verb} while running this call{why}",
                      reason, "worker")


class _Outcome:
    """What a handler records for metrics: the pool that served the call and its status code."""

    __slots__ = ("pool", "code")

    def __init__(self) -> None:
        self.pool = "-"
        self.code = "CANCELLED"      # unless the handler gets further


class _Writer:
    """Since when a Multiplex stream's write has waited on its client (0.0: none waits); its calls'
    flights read it (`Backend.stalled`)."""

    __slots__ = ("waiting",)

    def __init__(self) -> None:
        self.waiting = 0.0


class Forwarder:
    def __init__(self, router: Router, metrics: Metrics, security: ServerSecurity = ServerSecurity(),
                 max_request_bytes: int = 64 * 1024 * 1024, backlog: Backlog | None = None) -> None:
        self.router = router
        self.metrics = metrics
        self.security = security          # who the caller is (its workers take the pool server's word)
        self.limit = max_request_bytes
        self.stall = StallGuard()         # bounds each write to a Stream's caller (pool key reader_stall_s)
        self.backlog = backlog or Backlog()   # what the streams' callers have not read, in all (max_unread_bytes)
        self.turns = Turns()              # for parsing large requests, one at a time

    def handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(SERVICE, {
            "Call": grpc.unary_unary_rpc_method_handler(self.call),
            "Stream": grpc.unary_stream_rpc_method_handler(self.stream),
            "Release": grpc.unary_unary_rpc_method_handler(self.release),
            "Describe": grpc.unary_unary_rpc_method_handler(self.describe),
            "Collective": grpc.unary_unary_rpc_method_handler(self.collective),
            "Multiplex": grpc.stream_stream_rpc_method_handler(self.multiplex),
        })

    # ------------------------------------------------------------------------------------ helpers
    @staticmethod
    async def _abort(context: grpc.aio.ServicerContext, out: _Outcome, exc: BaseException) -> None:
        """Every failure of the router itself leaves as a rich status (and the exception lets go of
        its frames: `wire/errors.py` `abort`)."""
        if isinstance(exc, (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit)):
            return      # GeneratorExit: gRPC closed a Multiplex whose RPC ended (its deadline, say)
        if context.cancelled() or caller_gone(exc):
            # The caller went away (a stream its consumer stopped early): a write that fails now is
            # the cancellation, not a router failure, and there is nobody left to tell.
            out.code = "CANCELLED"
            forget_frames(exc)
            return
        if isinstance(exc, BridgeError):
            err = exc
        else:
            log.error("router failure", exc_info=exc)
            err = BridgeError(grpc.StatusCode.INTERNAL, "pool", f"router failure: {type(exc).__name__}: {exc}",
                              reason="router failure")
        out.code = err.code.name
        try:
            await abort(context, err.to_status(), exc)
        except (grpc.aio.AbortError, asyncio.CancelledError):
            raise
        except Exception as exc2:
            # A status behind a write the caller left unread waits for it, and it may go instead.
            if caller_gone(exc2):
                out.code = "CANCELLED"
                raise asyncio.CancelledError from None     # gRPC ends the handler quietly
            raise

    def _hold(self, context: grpc.aio.ServicerContext, caller: str, label: str, size: int,
              request: bool = False) -> BridgeError | None:
        """A unary reply (or, `request`, a large request) counts in the backlog until its RPC ends
        (the caller read it, or went; a request's bytes live as long as its handler), if it fits;
        else the RESOURCE_EXHAUSTED to end the call with."""
        h = self.backlog.open(caller, label)
        refused = self.backlog.take(h, size, label, request)
        if refused is not None:
            self.backlog.close(h)
            return refused
        if not request:
            self.backlog.writing(h, size)     # gRPC holds a reply until the caller reads it
        context.add_done_callback(lambda _: self.backlog.close(h))
        return None

    @staticmethod
    async def _lane_error(err: pb.MuxError, context: grpc.aio.ServicerContext, out: _Outcome) -> None:
        """The worker's error, as its own Call or Stream RPC would have ended."""
        out.code = status_code(err.code).name
        await abort(context, mux_error_status(err))

    # ------------------------------------------------------------------------------------ Call
    async def call(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        # One coroutine, and no await before the call reaches the worker's lane unless it must queue:
        # this is the hot path, and every extra step shows in the router's share of the latency.
        t0 = time.perf_counter()
        out = _Outcome()
        try:
            md = context.invocation_metadata()
            identity = self.security.identity(context)
            if self.backlog.over():
                self.backlog.admit(client_of(identity, context), "Call")
            if len(request) < LARGE_REQUEST_BYTES:
                head = routed_request(request, "Call", self.limit, self.router)
            else:
                refused = self._hold(context, client_of(identity, context), "Call", len(request), request=True)
                if refused is not None:
                    raise refused
                head = await read_in_turn(self.turns, client_of(identity, context), len(request),
                                          lambda: routed_request(request, "Call", self.limit, self.router), "Call",
                                          context.time_remaining())
            route = read_route(md, context.time_remaining(), head, identity)
            plan = self.router.plan(route)
            pool = plan.pool
            client = client_of(identity, context)
            backend = pool.take(plan, client) or await pool.wait(plan, route.deadline, client)
            self.router.placed(plan, backend, client)
            out.pool = pool.name
            flight = Flight()
            backend.flights.add(flight)
            lane = backend.lane
            try:
                try:
                    lc = lane.start(request, md, timeout_s=time_left(route), identity=identity,
                                    client=client_of(identity, context))
                    flight.call = lc
                    if lane.framed.paused:
                        await lane.drain()
                    event = await lc.next()
                except asyncio.CancelledError:
                    if flight.failed:
                        raise crashed(backend, flight.failed) from None
                    if flight.call is not None:
                        flight.call.cancel()
                    raise
                except LaneClosed as exc:
                    raise await _lane_failure(backend, flight, str(exc)) from None
                backend.refs = lane.refs
                if event.WhichOneof("kind") == "value":
                    out.code = "OK"
                    reply: bytes = pb.CallReplyView(value=event.value).SerializeToString()
                    if len(reply) >= COUNTED_UNARY_BYTES:     # gRPC holds it until the caller reads it
                        refused = self._hold(context, client_of(identity, context), "Call", len(reply))
                        if refused is not None:
                            del reply, event      # not kept by the traceback
                            raise refused
                    return reply
                await self._lane_error(event.error, context, out)
                raise AssertionError("unreachable: abort raises")
            finally:
                backend.flights.discard(flight)
                pool.release(backend, client)
        except BaseException as exc:
            await self._abort(context, out, exc)
            raise
        finally:
            # Counted just after the reply has gone out, not before: the caller need not wait for it.
            asyncio.get_running_loop().call_soon(self.metrics.observe_call, out.pool, "Call", out.code,
                                                 time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------ Collective
    async def collective(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        out = _Outcome()
        try:
            identity = self.security.identity(context)
            # whose each rank's call is, as for a Call (refs, sessions, aborts: the caller's own)
            forwarded = [*_forwarded(context.invocation_metadata(), identity), (MD_CLIENT, client_of(identity, context))]
            out.pool, reply = await run_collective(self.router, request, context, forwarded, self.limit, identity,
                                                   self.turns)
            out.code = "OK"
            return reply
        except BaseException as exc:
            await self._abort(context, out, exc)
            raise
        finally:
            self.metrics.observe_call(out.pool, "Collective", out.code, time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------ Stream
    async def stream(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        t0 = time.perf_counter()
        out = _Outcome()
        try:
            await self._stream(request, context, out)
        except BaseException as exc:
            await self._abort(context, out, exc)     # the worker slot is free already
            raise
        finally:
            self.metrics.observe_call(out.pool, "Stream", out.code, time.perf_counter() - t0)

    async def _stream(self, request: bytes, context: grpc.aio.ServicerContext, out: _Outcome) -> None:
        md = context.invocation_metadata()
        identity = self.security.identity(context)
        caller = client_of(identity, context)
        self.backlog.admit(caller, "Stream")
        if len(request) >= LARGE_REQUEST_BYTES and (refused := self._hold(context, caller, "Stream", len(request),
                                                                           request=True)) is not None:
            raise refused
        head = await read_in_turn(self.turns, caller, len(request),
                                  lambda: routed_request(request, "Stream", self.limit, self.router), "Stream",
                                  context.time_remaining())
        route = read_route(md, context.time_remaining(), head, identity)
        plan = self.router.plan(route)
        pool = plan.pool
        backend = pool.take(plan, caller) or await pool.wait(plan, route.deadline, caller)
        self.router.placed(plan, backend, caller)
        out.pool = pool.name
        flight = Flight()
        backend.flights.add(flight)
        lane = backend.lane
        lc = None
        stall_s = pool.config.reader_stall_s
        stalled: list[BridgeError] = []     # set when the pool ends the stream for its stalled caller
        end = functools.partial(_end_stalled, stalled, asyncio.current_task())
        holding = self.backlog.open(caller, "Stream", end)
        context.add_done_callback(lambda _: self.backlog.close(holding))
        try:
            try:
                lc = lane.start(request, md, stream=True, window=STREAM_WINDOW, timeout_s=time_left(route),
                                identity=identity, client=caller)
                flight.call = flight.lane_call = lc
                lc.on_stalled = flight.on_stalled = end
                index = taken = 0
                while (kind := (event := await lc.next()).WhichOneof("kind")) in ITEMS:
                    # gRPC's flow control holds the write back while the caller does not read; that is
                    # passed on to the worker as credit, and bounded by the pool's reader_stall_s. A
                    # patch (STREAM_ENCODING_PATCH_V1) goes on as bytes too.
                    if kind == "value":
                        item = pb.StreamItemView(index=index, value=event.value).SerializeToString()
                    else:
                        item = pb.StreamItemView(index=index, patch=event.patch).SerializeToString()
                    # (`flight.waiting`: the pool ends a stream whose write waits long while calls queue)
                    if len(item) < COUNTED_REPLY_BYTES:      # a token's item: nothing worth counting
                        await self.stall.wait(context.write(item), "Stream", stall_s, flight)
                    else:
                        refused = self.backlog.take(holding, len(item), "Stream")
                        if refused is not None:      # it does not fit: the stream ends
                            del item, event           # not kept by the traceback
                            raise refused
                        self.backlog.writing(holding, len(item))
                        await self.stall.wait(context.write(item), "Stream", stall_s, flight)
                        self.backlog.written(holding, len(item))
                    index += 1
                    taken += 1
                    if taken == _CREDIT_EVERY:
                        lc.credit(taken)
                        taken = 0
            except asyncio.CancelledError:
                if flight.failed:
                    raise crashed(backend, flight.failed) from None
                if stalled and (index or not holding.pending):
                    asyncio.current_task().uncancel()   # type: ignore[union-attr]  # a handler's task
                    raise stalled[0] from None
                # Ended in its first write: gRPC counts the headers sent only when that write is
                # done, so no status can follow it; the caller gets the item, then its deadline.
                raise
            except LaneClosed as exc:
                raise await _lane_failure(backend, flight, str(exc)) from None
            backend.refs = lane.refs
            if event.WhichOneof("kind") == "error":
                await self._lane_error(event.error, context, out)
            out.code = "OK"
        finally:
            self.backlog.unwind(holding)
            if lc is not None:
                lc.cancel()       # the caller went away first (or the call ended, then this does nothing)
            backend.flights.discard(flight)
            pool.release(backend, caller)

    # ------------------------------------------------------------------------------------ Multiplex
    async def multiplex(self, requests: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> None:
        t0 = time.perf_counter()
        out = _Outcome()
        # A write the caller leaves unread is bounded as a Stream's is (the stream holds the worker
        # slots of its calls, and what waits to be written): by the longest reader_stall_s of the pools.
        stall_s = self.router.reader_stall_s()
        writer = _Writer()     # since when a write waits: the pool ends the stream's calls under contention

        def write(reply: bytes) -> Awaitable[None]:
            return self.stall.wait(context.write(reply), "Multiplex", stall_s, writer)
        try:
            await forward_multiplex(self.router, requests, context, _lane_failure, write,
                                    self.security.identity(context), self.limit, self.backlog, self.turns, writer)
            out.code = "OK"
        except BaseException as exc:
            await self._abort(context, out, exc)
            raise
        finally:
            self.metrics.observe_call(out.pool, "Multiplex", out.code, time.perf_counter() - t0)

    # ------------------------------------------------------------------------------------ Release
    async def release(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        out = _Outcome()
        try:
            return await self._release(request, context, out)
        except BaseException as exc:
            await self._abort(context, out, exc)
            raise
        finally:
            self.metrics.observe_call(out.pool, "Release", out.code, time.perf_counter() - t0)

    async def _release(self, request: bytes, context: grpc.aio.ServicerContext, out: _Outcome) -> bytes:
        """Each worker gets its own refs; a session release goes to every worker of the pool (of
        every pool when the caller names none), and unpins the session."""
        md = context.invocation_metadata()
        identity = self.security.identity(context)
        route = read_route(md, context.time_remaining(), identity=identity)
        # (grouping millions of ids held the server's loop for seconds)
        req = await read_in_turn(self.turns, client_of(identity, context), len(request),
                                 lambda: read_release(request, self.limit), "Release", context.time_remaining())
        by_worker: dict[str, list[str]] = {}
        for ref in req.ref_ids:
            by_worker.setdefault(ref.partition(".")[0], []).append(ref)
        pools = [self.router.pool(route.opts.pool)] if route.opts.pool else list(self.router.pools.values())
        out.pool = pools[0].name if len(pools) == 1 else "-"
        targets: dict[str, Backend] = {b_id: b for b_id in by_worker if (b := self.router.backends.get(b_id))}
        session_backends: set[Backend] = set()
        if req.session_id:
            caller = client_of(identity, context)
            for p in pools:
                p.unpin_for(session_key(identity, req.session_id), caller)
                session_backends.update(p.backends)
            targets.update((b.id, b) for b in session_backends)
        # the client's connection too: without authentication a session's release ends only its refs
        fwd = [*_forwarded(md, identity), (MD_CLIENT, client_of(identity, context))]
        timeout = time_left(route)

        async def one(b: Backend) -> int:
            sub = pb.ReleaseRequest(ref_ids=by_worker.get(b.id, []),
                                    session_id=req.session_id if b in session_backends else "")
            try:
                return await release_on(b, sub, fwd, timeout)
            except grpc.aio.AioRpcError as err:
                if err.code() in _TRANSPORT_CODES and not _has_details(err):
                    return 0      # a worker that is going away takes its refs with it
                raise

        try:
            counts = await asyncio.gather(*(one(b) for b in targets.values()))
        except grpc.aio.AioRpcError as err:
            out.code = err.code().name
            await abort(context, status_of(err.code(), err.details() or "", tuple(err.trailing_metadata() or ())), err)
            raise
        out.code = "OK"
        reply: bytes = pb.ReleaseReply(released=sum(counts)).SerializeToString()
        return reply

    # ------------------------------------------------------------------------------------ Describe
    async def describe(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        t0 = time.perf_counter()
        out = _Outcome()
        try:
            md = context.invocation_metadata()
            parse_request(pb.DescribeRequest, request, "Describe", self.limit)
            route = read_route(md, context.time_remaining())
            backend = self.router.any_backend(route.opts.pool)
            out.pool = backend.pool
            identity = self.security.identity(context)
            try:
                reply: bytes = await backend.stubs[DESCRIBE](request, metadata=_forwarded(md, identity),
                                                             timeout=time_left(route))
            except grpc.aio.AioRpcError as err:
                out.code = err.code().name
                await abort(context, status_of(err.code(), err.details() or "", tuple(err.trailing_metadata() or ())), err)
                raise
            if len(reply) >= COUNTED_UNARY_BYTES:      # gRPC holds it until the caller reads it
                refused = self._hold(context, client_of(identity, context), "Describe", len(reply))
                if refused is not None:
                    del reply
                    raise refused
            out.code = "OK"
            return reply
        except BaseException as exc:
            await self._abort(context, out, exc)
            raise
        finally:
            self.metrics.observe_call(out.pool, "Describe", out.code, time.perf_counter() - t0)


def _end_stalled(stalled: list[BridgeError], task: asyncio.Task[Any] | None, err: BridgeError) -> None:
    """A Stream's end when the pool finds its caller stalled (`LaneCall.stall`) or holding the most
    unread replies (`Backlog`): its handler's task is cancelled and raises `err` instead (once: its
    lane call and its flight may both be found stalled)."""
    if stalled:
        return
    stalled.append(err)
    if task is not None:
        task.cancel()


async def _lane_failure(backend: Backend, flight: Flight, reason: str) -> BridgeError:
    """A lane that closes under its calls: the worker died (say so), or, rarely, the socket failed."""
    if flight.failed or await _died_within(backend, _DEATH_WAIT_S):
        return crashed(backend, flight.failed)
    return pool_error(grpc.StatusCode.UNAVAILABLE, f"worker {backend.id}: the connection to it failed ({reason})",
                      "worker connection lost", "worker")


async def _died_within(backend: Backend, seconds: float) -> bool:
    if backend.died.is_set():
        return True
    try:
        await asyncio.wait_for(backend.died.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True
