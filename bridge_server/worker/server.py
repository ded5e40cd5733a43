"""One worker process: the `Bridge` service over a catalog, plus the standard health and reflection
services.

A worker is a complete server on its own (any supervisor, ours or systemd or Elixir's, can start
one). With `lane` set it also serves the pool router's lane (`lane.py`): the same Multiplex
messages without HTTP/2, which is how the router sends it `Call` and `Stream`. The servicer only
translates between gRPC and the invoker: options and deadlines in, values or a rich error status out.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from bridge_server.wire.errors import BridgeError, server_error, target_label
from bridge_server.wire.jsonvalue import from_json
from bridge_server.wire.protocol import GRPC_OPTIONS, MD_WORKER_REFS, parse_metadata
from bridge_server.worker.catalog import Catalog, build_catalog, describe
from bridge_server.worker.deadlines import resolve_deadlines
from bridge_server.worker.invoke import Invoker
from bridge_server.worker.lane import LaneServer, serve_lane
from bridge_server.worker.mux import multiplex
from bridge_server.worker.refs import RefRegistry
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

log = logging.getLogger("vllm_bridge.worker")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Bridge"].full_name


@dataclass
class WorkerConfig:
    listen: str = "127.0.0.1:50051"
    worker_id: str = ""                    # default: "w" + pid
    session_cap: int = 10_000
    idle_ttl_s: float | None = None
    tensor_max_bytes: int = 16 * 1024 * 1024
    shared_threads: int = 16
    sweep_every_s: float = 5.0
    grace_s: float = 10.0
    extra_options: list[tuple[str, int]] = field(default_factory=list)
    # Objects to build at start and publish by name: {"name", "target", "args", "kwargs"} each.
    objects: list[dict[str, Any]] = field(default_factory=list)
    distributed: DistributedRank | None = None
    lane: str | None = None                # a unix socket path: also serve the router's lane there


@dataclass(frozen=True)
class DistributedRank:
    """This worker's place in a distributed pool: it joins the group before it reports ready."""

    backend: str                 # "gloo" on CPU, "nccl" with GPUs
    world_size: int
    rank: int
    init_method: str             # "tcp://127.0.0.1:PORT", the same for every rank of the group
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def __post_init__(self) -> None:
        if self.tensor_parallel_size * self.pipeline_parallel_size != self.world_size:
            raise ValueError(f"tensor_parallel_size {self.tensor_parallel_size} x pipeline_parallel_size "
                             f"{self.pipeline_parallel_size} must equal the world size {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is outside a world of {self.world_size}")


class BridgeService(pb_grpc.BridgeServicer):
    def __init__(self, invoker: Invoker) -> None:
        self.invoker = invoker
        self._catalog = describe(invoker.catalog)

    async def Call(self, request: pb.CallRequest, context: grpc.aio.ServicerContext) -> pb.CallReply:  # noqa: N802
        try:
            opts = parse_metadata(context.invocation_metadata())
            plan = self.invoker.plan(request.target)
            deadlines = resolve_deadlines(opts, context.time_remaining(), plan.profile)
            reply = pb.CallReply(value=await self.invoker.call(request, opts.session_id, deadlines, plan))
            context.set_trailing_metadata(((MD_WORKER_REFS, str(len(self.invoker.refs))),))
            return reply
        except Exception as exc:
            await context.abort_with_status(server_error(exc, target_label(request.target)).to_status())
            raise  # unreachable: abort raises

    async def Stream(self, request: pb.CallRequest,  # noqa: N802
                     context: grpc.aio.ServicerContext) -> AsyncIterator[pb.StreamItem]:
        try:
            opts = parse_metadata(context.invocation_metadata())
            plan = self.invoker.plan(request.target)
            deadlines = resolve_deadlines(opts, context.time_remaining(), plan.profile)
            index = 0
            async for item, put in self.invoker.stream(request, opts.session_id, deadlines,
                                                        opts.stream_interval_s, plan, opts.stream_encoding,
                                                        opts.stream_tee):
                out = pb.StreamItem(index=index)
                put(item, out)
                yield out
                index += 1
            context.set_trailing_metadata(((MD_WORKER_REFS, str(len(self.invoker.refs))),))
        except Exception as exc:
            await context.abort_with_status(server_error(exc, target_label(request.target)).to_status())

    async def Multiplex(self, request_iterator: AsyncIterator[pb.MuxRequest],  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[pb.MuxReply]:
        try:
            async for reply in multiplex(self.invoker, request_iterator, tuple(context.invocation_metadata() or ()),
                                         context.time_remaining):
                yield reply
            context.set_trailing_metadata(((MD_WORKER_REFS, str(len(self.invoker.refs))),))
        except Exception as exc:
            await context.abort_with_status(server_error(exc, "Multiplex").to_status())

    async def Collective(self, request: pb.CollectiveRequest,  # noqa: N802
                         context: grpc.aio.ServicerContext) -> pb.CollectiveReply:
        """A worker on its own is a group of one rank: the call runs once. Pools fan out in the router."""
        if len(request.per_rank) > 1:
            await context.abort_with_status(BridgeError.validation(
                f"Collective: this worker is a group of 1 rank, got calls for {len(request.per_rank)} ranks",
                parameter="per_rank").to_status())
        call = request.per_rank[0] if request.per_rank else request.call
        return pb.CollectiveReply(results=[await self.Call(call, context)])

    async def Release(self, request: pb.ReleaseRequest,  # noqa: N802
                      context: grpc.aio.ServicerContext) -> pb.ReleaseReply:
        refs = self.invoker.refs
        released = refs.release(list(request.ref_ids))
        if request.session_id:
            released += refs.release_session(request.session_id)
        context.set_trailing_metadata(((MD_WORKER_REFS, str(len(refs))),))
        return pb.ReleaseReply(released=released)

    async def Describe(self, request: pb.DescribeRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> pb.Catalog:
        if not request.prefix:
            return self._catalog
        return pb.Catalog(entries=[e for e in self._catalog.entries if e.name.startswith(request.prefix)],
                          vllm_version=self._catalog.vllm_version, bridge_version=self._catalog.bridge_version)


def default_catalog() -> Catalog:
    from adapters.all import SPECS
    return build_catalog(SPECS)


@dataclass
class Worker:
    """A built, not yet started worker: its server, services and state."""

    config: WorkerConfig
    server: grpc.aio.Server
    invoker: Invoker
    health: health.aio.HealthServicer
    port: int
    lane: LaneServer | None = None
    _sweeper: asyncio.Task[None] | None = field(default=None, init=False)

    async def start(self) -> None:
        """Serves at once (health NOT_SERVING) and reports SERVING once the configured objects exist."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.config.lane:
            self.lane = await serve_lane(self.invoker, self.config.lane)
        if self.config.distributed is not None:
            await self._join_group(self.config.distributed)
        for spec in self.config.objects:
            log.info("creating published object %r with %s", spec["name"], spec["target"])
            await self.invoker.create_object(spec["name"], spec["target"], from_json(spec.get("args", [])),
                                             from_json(spec.get("kwargs", {})))
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        self._sweeper = asyncio.create_task(self._sweep())

    async def _join_group(self, d: DistributedRank) -> None:
        """Through the catalog, like any client call, so it runs in the exclusive lane."""
        log.info("joining %s group: rank %d of %d (tp %d, pp %d) at %s", d.backend, d.rank, d.world_size,
                 d.tensor_parallel_size, d.pipeline_parallel_size, d.init_method)
        await self.invoker.call_python("vllm.distributed.init_distributed_environment", [], dict(
            world_size=d.world_size, rank=d.rank, distributed_init_method=d.init_method, local_rank=d.rank,
            backend=d.backend))
        await self.invoker.call_python("vllm.distributed.initialize_model_parallel",
                                       [d.tensor_parallel_size, d.pipeline_parallel_size], {})

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(self.config.sweep_every_s)
            self.invoker.refs.sweep()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking calls, lets in-flight ones finish within the grace period, then releases refs."""
        await self.health.enter_graceful_shutdown()
        grace = self.config.grace_s if grace_s is None else grace_s
        await asyncio.gather(self.server.stop(grace), *([self.lane.stop(grace)] if self.lane else []))
        if self._sweeper is not None:
            self._sweeper.cancel()
        self.invoker.refs.close()
        for obj in self.invoker.objects.values():
            self.invoker.catalog.finalize(obj)
        self.invoker.close()


def build_worker(config: WorkerConfig, catalog: Catalog | None = None,
                 objects: dict[str, object] | None = None) -> Worker:
    worker_id = config.worker_id or f"w{os.getpid()}"
    catalog = catalog or default_catalog()
    refs = RefRegistry(worker_id, session_cap=config.session_cap, idle_ttl_s=config.idle_ttl_s,
                       finalize=catalog.finalize)
    invoker = Invoker(catalog, refs, objects=dict(objects or {}), tensor_max_bytes=config.tensor_max_bytes,
                      shared_threads=config.shared_threads)
    server = grpc.aio.server(options=GRPC_OPTIONS + config.extra_options)
    pb_grpc.add_BridgeServicer_to_server(BridgeService(invoker), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    port = server.add_insecure_port(config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    return Worker(config, server, invoker, health_servicer, port)


async def serve_worker(config: WorkerConfig, ready_file: str | None = None) -> None:
    """Runs a worker until SIGTERM/SIGINT, then shuts down gracefully."""
    worker = build_worker(config)
    try:
        await worker.start()
    except BaseException:
        await worker.stop(0)
        raise
    log.info("worker %s serving on %s (port %d)", worker.invoker.refs.worker_id, config.listen, worker.port)
    if ready_file:
        with open(ready_file, "w") as f:
            f.write(str(worker.port))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    log.info("worker stopping: letting in-flight calls finish (grace %.1f s)", config.grace_s)
    await worker.stop()
