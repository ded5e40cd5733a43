"""Requests read within bounds: how many are in receipt at once, in all and from one host, for how
long, and how many request streams one host holds open.

gRPC reads a unary request whole, up to the server's max_request_bytes, before any handler runs, and
sets no bound on how many it reads at once: a gigabyte of receive buffers costs a stranger a
gigabyte of sending. 32 requests of 60 MiB sent at once took the pool server to 3.2 GB, about
100 MB each; 200 would take a 24 GB machine past its memory, and every worker and engine with it.
Nothing before the read knows a request's size, so each request in receipt counts as the largest
one allowed, and what the bound decides is when a request is read at all: a request that waits for
its turn holds only what HTTP/2 lets its sender send before anyone reads (the stream's window).

So every unary-request method of the server, ours and the standard services alike, is served as a
request stream whose one message this gate reads itself (the wire is the same: one message, then
the end of the stream), once the request has a place (`ReceiveLimits`). A sender that trickles or
stops halfway gives its place back `receive_s` after its call started, its call ended; requests
waiting for a place are bounded too, by host and in all (each holds what its sender sent first). A method that reads a stream of
requests (Multiplex, reflection) reads them as they come, for as long as the stream lives, so one
host holds at most `streams_per_host` such streams open at once instead.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from bridge_server.wire.errors import BridgeError, abort
from bridge_server.wire.open_services import PerHost
from bridge_server.wire.protocol import host_of

__all__ = ["DEFAULT_RECEIVING_BYTES", "STALL_S", "ReceiveGate", "ReceiveLimits"]

DEFAULT_RECEIVING_BYTES = 1 << 30   # requests in receipt at once, each counted as the largest allowed
# How long a request may hold a place while another host's requests wait for one. Nothing says when a
# request's bytes begin to arrive, so a call that sent its headers and nothing more held a place for
# all of receive_s: 4 of them held one address's share for 30 s at a time (its health checks and its
# authenticated callers' calls failing), and 4 addresses' would have held every place. Past stall_s the
# place goes to the next host waiting, in turn: what still waits is a stalled sender's, not the others'.
# A request of 64 MiB arrives well within it at 10 MB/s. (A host is an identity or an address.)
STALL_S = 10.0
# A call's metadata, keys and values together (gRPC's own limit, which it applies only once the client
# has acknowledged the server's HTTP/2 settings: until then headers of 4-5 MB passed, and 600 health
# watches of 2 MB headers held 1 GB of the pool server for as long as their connection stayed open).
MAX_CALL_METADATA_BYTES = 16 * 1024
IDENTITY = "identity "      # how a host that is a caller's identity is told from an address
_WRAPPED_KEPT = 1024        # handlers a server has: a few dozen; more are made per call (not kept)


@dataclass(frozen=True)
class ReceiveLimits:
    """`at_once`: requests in receipt at once, in all; `per_host`: of those, from one host;
    `receive_s`: how long one may take to arrive, its wait for a place included; `stall_s`: how long
    one may hold a place while other hosts' requests wait for one; `streams_per_host`: request streams one
    host holds; `waiting_per_host`, `waiting_at_once`: requests waiting for a place, from one host and
    in all (past them a request is refused at once). A "host" is a caller's identity when its call
    carries a listed token, else its address."""

    at_once: int = 16
    per_host: int = 4
    receive_s: float = 30.0
    streams_per_host: int = 32
    waiting_per_host: int = 1024       # requests waiting for a place, from one host ...
    waiting_at_once: int = 8192        # ... and in all
    stall_s: float = STALL_S

    @classmethod
    def for_requests(cls, max_request_bytes: int, max_receiving_bytes: int, receive_s: float = 30.0,
                     streams_per_host: int = 32, stall_s: float = STALL_S) -> ReceiveLimits:
        """As many requests in receipt as `max_receiving_bytes` holds of the largest allowed, and at
        least 4; a quarter of them for one host, so that one host stalling its sends leaves the
        rest to the others."""
        at_once = max(4, max_receiving_bytes // max(1, max_request_bytes))
        return cls(at_once, max(1, at_once // 4), receive_s, streams_per_host, stall_s=min(stall_s, receive_s))


class _Places:
    """Places for requests in receipt, handed out in order of asking, each host's turn by turn."""

    def __init__(self, limits: ReceiveLimits, anonymous_at_once: int | None = None) -> None:
        self.limits = limits
        # On a server with tokens, the places callers without one (the open services' callers) may
        # hold at once: header-only health checks from 4 addresses had held every place, so that
        # each authenticated call waited stall_s, and an authenticated slow upload was ended for them.
        self.anonymous_at_once = anonymous_at_once
        self.anonymous = 0
        self.taken = 0
        self.by_host: dict[str, int] = {}
        self.waiting: dict[str, collections.deque[asyncio.Future[None]]] = {}
        self.waiters = 0

    def crowded(self, host: str) -> str:
        """Why no more requests may wait for a place (how many wait, of this host or in all); ""
        while more may. A waiting request holds what HTTP/2 let its sender send (~80 KB with its
        call): 64,000 of one host's, 4,000 on each of 16 connections, had taken the server to 4.7 GB."""
        mine = len(self.waiting.get(host, ()))
        if mine >= self.limits.waiting_per_host:
            return f"this host has {mine:,}"
        if self.waiters >= self.limits.waiting_at_once:
            return f"{self.waiters:,}"
        return ""

    def others_wait(self, host: str) -> bool:
        """Whether a host other than `host` waits for a place it could take (its share not full):
        a host's own requests, waiting behind its own, stall only itself; and a caller without a
        token never ends the read of one with a token."""
        per_host = self.limits.per_host
        named = host.startswith(IDENTITY)
        return any(other != host and self.by_host.get(other, 0) < per_host and (not named or other.startswith(IDENTITY))
                   for other in self.waiting)

    def _room(self, host: str) -> bool:
        if self.taken >= self.limits.at_once or self.by_host.get(host, 0) >= self.limits.per_host:
            return False
        return self.anonymous_at_once is None or host.startswith(IDENTITY) or self.anonymous < self.anonymous_at_once

    def try_take(self, host: str) -> bool:
        if host not in self.waiting and self._room(host):
            self._give(host)
            return True
        return False

    async def take(self, host: str) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(host, collections.deque()).append(future)
        self.waiters += 1
        try:
            await future
        except BaseException:
            if future.done() and not future.cancelled():
                self.give_back(host)    # handed over just as the call went: pass it on
            else:
                self._forget(host, future)
            raise
        finally:
            self.waiters -= 1

    def give_back(self, host: str) -> None:
        self.taken -= 1
        if not host.startswith(IDENTITY):
            self.anonymous -= 1
        left = self.by_host[host] - 1
        if left:
            self.by_host[host] = left
        else:
            del self.by_host[host]
        self._hand_over()

    def _give(self, host: str) -> None:
        self.taken += 1
        if not host.startswith(IDENTITY):
            self.anonymous += 1
        self.by_host[host] = self.by_host.get(host, 0) + 1

    def _forget(self, host: str, future: asyncio.Future[None]) -> None:
        queue = self.waiting.get(host)
        if queue is not None:
            try:
                queue.remove(future)
            except ValueError:
                pass
            if not queue:
                del self.waiting[host]

    def _hand_over(self) -> None:
        """The free places go to the hosts waiting, one each in turn, oldest host first."""
        if not self.waiting:
            return      # nearly every call: nobody waits
        for host in list(self.waiting):
            if self.taken >= self.limits.at_once:
                return
            if not self._room(host):
                continue
            queue = self.waiting.pop(host)
            while queue:
                future = queue.popleft()
                if not future.done():
                    self._give(host)
                    future.set_result(None)
                    break
            if queue:
                self.waiting[host] = queue     # to the back of the line of hosts


def _refusal(method: str, code: grpc.StatusCode, message: str, reason: str) -> BridgeError:
    label = method.rsplit("/", 1)[-1] or method
    return BridgeError(code, "validation", f"{label}: {message}", target=label, parameter="request", reason=reason)


class ReceiveGate(grpc.aio.ServerInterceptor):
    """The outermost interceptor of a server that strangers reach (see the module's docstring)."""

    def __init__(self, limits: ReceiveLimits,
                 identify: Callable[[Any], str | None] | None = None) -> None:
        self.limits = limits
        self.identify = identify        # a call's identity from its metadata, when the server has tokens
        self.places = _Places(limits, None if identify is None else max(1, limits.at_once // 2))
        self.streams = PerHost(limits.streams_per_host)
        self._wrapped: dict[int, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}
        self._reading: dict[asyncio.Task[Any], float] = {}     # the reads under way, since when
        self._placed: dict[asyncio.Task[Any], tuple[float, str]] = {}   # ... those with a place: since, whose
        self._expired: dict[asyncio.Task[Any], str] = {}       # ... and those the sweeper ended, why
        self._sweeper: asyncio.Task[None] | None = None

    def _host(self, context: grpc.aio.ServicerContext, method: str) -> str:
        """Whom a call counts for (its identity, when it carries a listed token, else its address),
        once its metadata is within bounds."""
        metadata = context.invocation_metadata() or ()
        size = sum(len(key) + len(value) for key, value in metadata)
        if size > MAX_CALL_METADATA_BYTES:
            raise _refusal(method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                           f"{size:,} bytes of metadata, over this server's limit of {MAX_CALL_METADATA_BYTES:,}",
                           "metadata too large")
        if self.identify is not None:
            identity = self.identify(metadata)
            if identity:
                return IDENTITY + identity
        return host_of(context.peer() or "")

    async def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails],
                                                             Awaitable[grpc.RpcMethodHandler]],
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None     # UNIMPLEMENTED, sent before anything is read
        kept = self._wrapped.get(id(handler))
        if kept is not None and kept[0] is handler:
            return kept[1]
        wrapped = self._wrap(handler, handler_call_details.method)   # type: ignore[attr-defined]
        if len(self._wrapped) < _WRAPPED_KEPT:
            self._wrapped[id(handler)] = (handler, wrapped)
        return wrapped

    # ---------------------------------------------------------------------------- one request
    async def _read(self, requests: Any, context: grpc.aio.ServicerContext, method: str) -> Any:
        """The request's one message, read once it has a place; the place is given back once it is
        read, or its call ends. receive_s counts from the request's arrival, its wait included."""
        host = self._host(context, method)
        places = self.places
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self._reading[task] = loop.time()
        if self._sweeper is None or self._sweeper.done():
            self._sweeper = loop.create_task(self._sweep())
        try:
            if not places.try_take(host):
                why = places.crowded(host)
                if why:
                    raise _refusal(method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"{why} requests wait to be read, the most there may be: each holds what its "
                                   f"sender sent before a read (up to 64 KiB); try again once fewer are under way",
                                   "too many waiting")
                await places.take(host)
            self._placed[task] = (loop.time(), host)
            try:
                raw = await context.read()
                # and then the end of the stream: a unary request is one message (a second, even of
                # garbage, was ignored); a sender that keeps its stream open holds its place meanwhile
                more = grpc.aio.EOF if raw is grpc.aio.EOF else await context.read()
            finally:
                del self._placed[task]
                places.give_back(host)
        except asyncio.CancelledError:
            why = self._expired.pop(task, "")
            if not why:
                raise
            task.uncancel()
            raise self._expiry(method, why) from None
        finally:
            del self._reading[task]
        if raw is grpc.aio.EOF:
            raise _refusal(method, grpc.StatusCode.INVALID_ARGUMENT,
                           "expected one request message, got none (the stream ended first, or its message was "
                           "cut short)", "no request")
        if more is not grpc.aio.EOF:
            raise _refusal(method, grpc.StatusCode.INVALID_ARGUMENT,
                           "expected one request message, got more: this method takes one", "more than one request")
        return raw

    def _expiry(self, method: str, why: str) -> BridgeError:
        limits = self.limits
        if why == "stalled":
            said = (f"its request had not arrived {limits.stall_s:g} s (stall_s) after it was given a place to be "
                    f"read in, while another host's request waited for one: the server reads {limits.at_once} at "
                    f"once, each counted as the largest allowed")
        elif why == "waited":
            said = (f"its request waited {limits.receive_s:g} s (receive_s) for a place to be read in, all of "
                    f"those its sender may hold ({limits.per_host} for one host or identity, {limits.at_once} in "
                    f"all) being held by others' requests; try again")
        else:
            said = (f"its request did not arrive within {limits.receive_s:g} s (receive_s) of its call's start: a "
                    f"request in receipt holds a place among the {limits.at_once} the server reads at once")
        return _refusal(method, grpc.StatusCode.RESOURCE_EXHAUSTED, said, "request too slow")

    async def _sweep(self) -> None:
        """Ends the reads that have taken longer than receive_s, and those that have held a place for
        stall_s while another host's request waits for one, while any read is under way: one sweeper, not a timer per
        request (a timer each cost a trivial call ~25 µs of the server's CPU)."""
        loop = asyncio.get_running_loop()
        every = min(1.0, self.limits.receive_s / 4, self.limits.stall_s / 4)
        while self._reading:
            await asyncio.sleep(every)
            now = loop.time()
            late, stalled = now - self.limits.receive_s, now - self.limits.stall_s
            for task, since in list(self._reading.items()):
                if since <= late and task not in self._expired:
                    self._expired[task] = "late" if task in self._placed else "waited"
                    task.cancel()
            wanted = self.places.waiters
            for task, (since, host) in sorted(self._placed.items(), key=lambda kv: kv[1][0]):
                if wanted <= 0 or since > stalled:
                    break       # as many places as requests wait, the longest held first
                if task not in self._expired and self.places.others_wait(host):
                    self._expired[task] = "stalled"
                    task.cancel()
                    wanted -= 1

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        deserialize = handler.request_deserializer
        serialize = handler.response_serializer
        if handler.request_streaming:
            return self._wrap_streams(handler, method)

        async def request_of(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                raw = await self._read(requests, context, method)
                if deserialize is None:
                    return raw
                try:
                    return deserialize(raw)
                except Exception as exc:    # noqa: BLE001 - any parse failure is the request's
                    raise _refusal(method, grpc.StatusCode.INVALID_ARGUMENT,
                                   f"its request is not a valid message: {type(exc).__name__}", "malformed") from None
            except BridgeError as err:
                await abort(context, err.to_status(), err)

        if not handler.response_streaming:
            behavior = handler.unary_unary

            async def unary(requests: Any, context: grpc.aio.ServicerContext) -> Any:
                reply = behavior(await request_of(requests, context), context)
                return await reply if inspect.isawaitable(reply) else reply
            return grpc.stream_unary_rpc_method_handler(unary, response_serializer=serialize)

        streaming = handler.unary_stream

        async def stream(requests: Any, context: grpc.aio.ServicerContext) -> None:
            await _respond(streaming, await request_of(requests, context), context)
        return grpc.stream_stream_rpc_method_handler(stream, response_serializer=serialize)

    # ---------------------------------------------------------------------------- request streams
    def _wrap_streams(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        streaming = handler.response_streaming
        behavior = handler.stream_stream if streaming else handler.stream_unary
        cap = self.limits.streams_per_host

        async def opened(context: grpc.aio.ServicerContext) -> str:
            try:
                host = self._host(context, method)
            except BridgeError as refused:
                await abort(context, refused.to_status(), refused)
            if not self.streams.take(host):
                err = _refusal(method, grpc.StatusCode.RESOURCE_EXHAUSTED,
                               f"this host holds {cap} request streams open (Multiplex, reflection), the most "
                               f"one host may (streams_per_host {cap}): send more calls over the streams it has",
                               "too many streams")
                await abort(context, err.to_status(), err)
            return host

        closed = self.streams.give

        if not streaming:
            async def unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
                host = await opened(context)
                try:
                    return await behavior(_Reads(context), context)
                finally:
                    closed(host)
            return grpc.stream_unary_rpc_method_handler(unary, request_deserializer=handler.request_deserializer,
                                                        response_serializer=handler.response_serializer)

        async def stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> None:
            host = await opened(context)
            try:
                await _respond(behavior, _Reads(context), context)
            finally:
                closed(host)
        return grpc.stream_stream_rpc_method_handler(stream, request_deserializer=handler.request_deserializer,
                                                     response_serializer=handler.response_serializer)


class _Reads:
    """A request stream's messages, each read when asked for and then the asker's alone. gRPC's own
    iterator is a generator that keeps the message it gave last until it is asked for the next: a
    Multiplex stream that sent one 60 MiB request and then nothing kept those bytes for as long as it
    stayed open, its call long over (32 such streams from one host: 1.9 GB, counted nowhere)."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.aio.ServicerContext) -> None:
        self._context = context

    def __aiter__(self) -> _Reads:
        return self

    async def __anext__(self) -> Any:
        message = await self._context.read()
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return message


async def _respond(behavior: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
    """A streaming handler's replies, however it gives them: written by itself through the context
    (ours), or yielded (written here, one at a time, as gRPC would)."""
    if inspect.iscoroutinefunction(behavior):
        await behavior(request, context)
        return
    replies = behavior(request, context)
    if not hasattr(replies, "__aiter__"):
        for reply in replies:
            await context.write(reply)
        return
    try:
        async for reply in replies:
            await context.write(reply)
    finally:
        await replies.aclose()     # its cleanup now, not when a collection finds it
