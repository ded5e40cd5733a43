"""The services a stranger reaches without a token (unless `--auth-health`): the standard health
and reflection services, as both servers register them, and our `Pool/Status`. Their stock servicers
keep what a request brings for as long as its stream lasts, so what one host may make them keep is
bounded here: the size of what it asks, and the streams it holds open.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from google.protobuf.message import Message
from grpc_reflection.v1alpha import reflection, reflection_pb2

from bridge_server.wire.errors import BridgeError, abort
from bridge_server.wire.protocol import host_of, parse_request, parsed_service, serialize, small_request, stop_reading

__all__ = ["MAX_OPEN_REQUEST_BYTES", "MAX_REFLECTION_STREAMS_PER_HOST", "MAX_WATCHES_PER_HOST", "HealthWatches",
           "PerHost", "health_and_status", "reflection_service"]

# What a request to these services names (a service, a pool, a file, a symbol, a type) needs far less
# than this; the request is refused by its size before it is parsed. The check of a health service
# name's length alone let 50 MB of unknown fields through, kept for as long as the watch lasted.
MAX_OPEN_REQUEST_BYTES = 16 << 10


@dataclass
class PerHost:
    """How many streams of one kind each host holds open, at most `limit` each."""

    limit: int
    by_host: dict[str, int] = field(default_factory=dict)

    def take(self, host: str) -> bool:
        held = self.by_host.get(host, 0)
        if held >= self.limit:
            return False
        self.by_host[host] = held + 1
        return True

    def give(self, host: str) -> None:
        left = self.by_host[host] - 1
        if left:
            self.by_host[host] = left
        else:
            del self.by_host[host]

    def refusal(self, rpc: str, what: str, reason: str) -> BridgeError:
        return BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                           f"{rpc}: this host holds {self.limit:,} {what} open, the most one host may: end some first",
                           reason=reason)


# The health service answers without a token (unless `--auth-health`), so what a request may make it
# keep is bounded: a service name (ours are "" and "pool/<name>"), and the Watch streams one host holds
# open at once. grpcio-health-checking's servicer keeps a watched name, the request and its bytes for
# as long as the stream lasts: 6 watches of 60 MB names held 1.7 GB of the pool server, and 90,000 small
# ones from one host 600 MB.
MAX_HEALTH_SERVICE_CHARS = 256
MAX_WATCHES_PER_HOST = 1024


def _health_service_name(request: Any, rpc: str) -> None:
    if len(request.service) > MAX_HEALTH_SERVICE_CHARS:
        raise BridgeError.validation(f"{rpc}: service: a name of {len(request.service):,} characters is over the "
                                     f"limit of {MAX_HEALTH_SERVICE_CHARS}", parameter="service")


@dataclass
class HealthWatches:
    """The health service's Watch streams in progress. grpcio-health-checking's servicer holds each
    open for as long as its client does, and a stopping server waits for every RPC until its grace
    period ends: one idle watcher kept it 30 s. At shutdown each says NOT_SERVING, then ends (OK).
    One host holds at most MAX_WATCHES_PER_HOST open at once."""
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    ending: bool = False
    hosts: PerHost = field(default_factory=lambda: PerHost(MAX_WATCHES_PER_HOST))

    async def watch(self, health: Any, request: Any, context: grpc.aio.ServicerContext) -> None:
        rpc = "grpc.health.v1.Health/Watch"
        try:
            _health_service_name(request, rpc)
        except BridgeError as exc:
            await abort(context, exc.to_status(), exc)
        host = host_of(context.peer() or "")
        if not self.hosts.take(host):
            await abort(context, self.hosts.refusal(rpc, "watches", "too many watches").to_status())
        task: asyncio.Task[None] = asyncio.ensure_future(health.Watch(request, context))
        self.tasks.add(task)
        try:
            await asyncio.shield(task)
        except asyncio.CancelledError:
            if not (self.ending and task.cancelled()):
                task.cancel()          # the caller went: its watch goes with it
                raise
        finally:
            self.tasks.discard(task)
            self.hosts.give(host)

    async def check(self, health: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        try:
            _health_service_name(request, "grpc.health.v1.Health/Check")
        except BridgeError as exc:
            await abort(context, exc.to_status(), exc)
        return await health.Check(request, context)

    async def end(self, said_s: float = 0.1) -> None:
        """Ends them, once they had `said_s` to send the status the shutdown set."""
        self.ending = True
        if self.tasks:
            await asyncio.sleep(said_s)
        for task in list(self.tasks):
            task.cancel()


def health_and_status(health: Any, status: Callable[..., Awaitable[object]],
                      watches: HealthWatches) -> list[grpc.GenericRpcHandler]:
    """The standard health service (`health`: grpcio-health-checking's aio servicer; its Watch
    streams kept in `watches`) and our `Pool/Status`, as both servers register them."""
    from grpc_health.v1 import health_pb2

    from vllm_bridge.v1 import pool_pb2
    request = health_pb2.HealthCheckRequest
    return [parsed_service(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                           {"Check": (functools.partial(watches.check, health), request, False),
                            "Watch": (functools.partial(watches.watch, health), request, True)},
                           MAX_OPEN_REQUEST_BYTES, "a health request names a service"),
            parsed_service(pool_pb2.DESCRIPTOR.services_by_name["Pool"].full_name,
                           {"Status": (status, pool_pb2.StatusRequest, False)},
                           MAX_OPEN_REQUEST_BYTES, "a status request names a pool")]


# Server reflection copies each request into its reply (`original_request`), and a reply the caller
# does not read stays in the server: 12 streams that each sent one 60 MB request and read nothing
# held 3 GB of the pool server (and 0.8 GB after they closed). A stream answers one request at a
# time (the next waits for the reply before it to be written), so a host's streams hold at most
# MAX_REFLECTION_STREAMS_PER_HOST requests (of MAX_OPEN_REQUEST_BYTES) and their replies.
MAX_REFLECTION_STREAMS_PER_HOST = 64


def reflection_service(service_names: Sequence[str], streams: PerHost | None = None) -> grpc.GenericRpcHandler:
    """grpcio-reflection's servicer for `service_names` (and itself), behind those bounds."""
    names = (*service_names, reflection.SERVICE_NAME)
    servicer = reflection.aio.ReflectionServicer(names, pool=served_files(names))
    hosts = streams if streams is not None else PerHost(MAX_REFLECTION_STREAMS_PER_HOST)
    rpc = f"{reflection.SERVICE_NAME}/ServerReflectionInfo"

    async def requests(raw: AsyncIterator[bytes]) -> AsyncIterator[Message]:
        received = raw.__aiter__()
        async for data in received:
            size = len(data)
            if size > MAX_OPEN_REQUEST_BYTES:
                # nothing of the refused request stays: not with the error, nor in gRPC's reader
                del data
                await stop_reading(received)
                small_request(size, MAX_OPEN_REQUEST_BYTES, rpc,
                              "a reflection request names a file, a symbol or a type", "request too large")
            yield parse_request(reflection_pb2.ServerReflectionRequest, data, rpc)

    async def info(raw: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> AsyncIterator[Message]:
        host = host_of(context.peer() or "")
        if not hosts.take(host):
            await abort(context, hosts.refusal(rpc, "reflection streams", "too many streams").to_status())
        refused = None
        try:
            async for reply in servicer.ServerReflectionInfo(requests(raw), context):
                yield reply
        except BridgeError as exc:
            refused = exc.to_status()
        finally:
            hosts.give(host)
        if refused is not None:     # (outside the handler: the abort carries no chain of frames)
            await abort(context, refused)

    return grpc.method_handlers_generic_handler(reflection.SERVICE_NAME, {
        "ServerReflectionInfo": grpc.stream_stream_rpc_method_handler(info, response_serializer=serialize)})


def served_files(service_names: Sequence[str]) -> descriptor_pool.DescriptorPool:
    """The proto files that describe `service_names`, with what they import, and nothing else.
    Reflection answers from a pool of descriptors, by default the process's own, which holds every
    file any imported library has loaded (vLLM's, protobuf's own `descriptor.proto`, ...): a stranger
    could list names the documents never describe. A pool of its own serves the contract only."""
    default = descriptor_pool.Default()
    served = descriptor_pool.DescriptorPool()
    added: set[str] = set()

    def add(file: Any) -> None:
        if file.name in added:
            return
        for dependency in file.dependencies:    # a file is added after what it imports
            add(dependency)
        proto = descriptor_pb2.FileDescriptorProto()
        file.CopyToProto(proto)
        served.Add(proto)
        added.add(file.name)

    for name in service_names:
        add(default.FindServiceByName(name).file)
    return served
