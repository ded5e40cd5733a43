"""One worker process: the `Bridge` service over a catalog, plus the standard health and reflection
services.

A worker is a complete server on its own (any supervisor, ours or systemd or Elixir's, can start
one). With `lane` set it also serves the pool router's lane (`lane.py`): the same Multiplex
messages without HTTP/2, which is how the router sends it `Call` and `Stream`. The servicer only
translates between gRPC and the invoker: options and deadlines in, values or a rich error status out.

Its health tells the truth: NOT_SERVING until its published objects exist and are warmed up, and
again whenever `liveness.py` finds that it cannot serve (a published engine dead and being created
again, a call stuck in the exclusive lane). `vllm_bridge.v1.Pool/Status` says why, for its
supervisor and for `vllm-bridge status` (a lone worker is a pool of one).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2

from adapters.spec import Policy
from bridge_server.wire import eventloop
from bridge_server.wire.errors import BridgeError, abort, caller_gone, server_error, target_label
from bridge_server.wire.jsonvalue import from_json
from bridge_server.wire.open_services import HealthWatches, health_and_status, reflection_service
from bridge_server.wire.options import MD_WORKER_REFS, RuntimeOptions, connection_of, parse_metadata
from bridge_server.wire.protocol import (
    MIN_PING_INTERVAL_S,
    UNCOMPRESSED_REQUESTS,
    LargeRequest,
    M,
    collective_calls,
    parse_request,
    read_call,
    read_release,
    server_options,
)
from bridge_server.wire.receiving import DEFAULT_RECEIVING_BYTES, ReceiveGate, ReceiveLimits
from bridge_server.wire.security import ServerSecurity, check_exposure
from bridge_server.worker.catalog import Catalog, build_catalog, describe
from bridge_server.worker.deadlines import resolve_deadlines
from bridge_server.worker.invoke import Caller, Invoker, Limits
from bridge_server.worker.lane import LaneServer, serve_lane
from bridge_server.worker.liveness import Liveness, ObjectConfig
from bridge_server.worker.mux import multiplex
from bridge_server.worker.openfiles import files_cap, open_files
from bridge_server.worker.peers import open_peers
from bridge_server.worker.reclaim import end_idle_engines, end_orphans, orphan_candidates
from bridge_server.worker.refs import RefRegistry
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import pool_pb2 as ppb

log = logging.getLogger("vllm_bridge.worker")

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Bridge"].full_name
POOL_SERVICE = ppb.DESCRIPTOR.services_by_name["Pool"].full_name


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
    security: ServerSecurity = field(default_factory=ServerSecurity)
    insecure: bool = False                 # listen beyond this machine without TLS and tokens anyway
    policy: Policy = field(default_factory=Policy)
    limits: Limits = field(default_factory=Limits)
    max_sessions: int = 10_000
    max_refs_per_client: int = 100_000
    max_ref_bytes_per_client: int = 1 << 30   # tensors held in one client's refs (0: no limit)
    max_request_bytes: int = 64 * 1024 * 1024
    warmup: bool = True                    # published (and client-made) engines run once before they serve
    probe_interval_s: float = 5.0          # how often engines are probed (liveness.py)
    probe_timeout_s: float = 10.0          # two probes unanswered this long (no progress meanwhile): dead
    min_ping_interval_s: float = MIN_PING_INTERVAL_S   # clients may keepalive-ping an idle connection this often


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


class BridgeService:
    """The `Bridge` RPCs of one worker. Requests arrive as bytes and are parsed here, so that bytes
    that are not the RPC's message end that call with INVALID_ARGUMENT saying so (gRPC's own
    deserializer would answer UNKNOWN with a generic text)."""

    def __init__(self, invoker: Invoker, security: ServerSecurity, trusted: bool, max_request_bytes: int) -> None:
        self.invoker = invoker
        self.security = security
        self.trusted = trusted        # its peers speak for their clients (a supervised worker without tokens)
        self.max_request_bytes = max_request_bytes
        self._catalog = describe(invoker.catalog)

    def _identity(self, context: grpc.aio.ServicerContext) -> str:
        return self.security.identity(context, context.invocation_metadata() if self.trusted else ())

    def _caller(self, context: grpc.aio.ServicerContext, opts: RuntimeOptions) -> Caller:
        identity = self._identity(context)
        if self.trusted:     # a pool server's own call (a Collective's share): it names the client
            return Caller(identity, opts.session_id, opts.collective, opts.client or identity, opts.collective_check)
        return Caller(identity, opts.session_id, False, identity or context.peer() or "")

    def _read(self, cls: type[M], raw: bytes, rpc: str) -> M:
        return parse_request(cls, raw, rpc, self.max_request_bytes)

    def handler(self) -> grpc.GenericRpcHandler:
        def unary(fn: Any, reply: Any) -> grpc.RpcMethodHandler:
            return grpc.unary_unary_rpc_method_handler(fn, response_serializer=reply.SerializeToString)
        return grpc.method_handlers_generic_handler(SERVICE_NAME, {
            "Call": unary(self.Call, pb.CallReply),
            "Stream": grpc.unary_stream_rpc_method_handler(self.Stream,
                                                           response_serializer=pb.StreamItem.SerializeToString),
            "Multiplex": grpc.stream_stream_rpc_method_handler(self.Multiplex),   # replies serialized by mux.py
            "Collective": unary(self.Collective, pb.CollectiveReply),
            "Release": unary(self.Release, pb.ReleaseReply),
            "Describe": unary(self.Describe, pb.Catalog),
        })

    def _refs_trailer(self, context: grpc.aio.ServicerContext) -> None:
        context.set_trailing_metadata(((MD_WORKER_REFS, str(len(self.invoker.refs))),))

    async def _call(self, request: pb.CallRequest | LargeRequest, context: grpc.aio.ServicerContext) -> pb.CallReply:
        opts = parse_metadata(context.invocation_metadata())
        caller = self._caller(context, opts)
        plan = self.invoker.plan(request.target, caller)
        deadlines = resolve_deadlines(opts, context.time_remaining(), plan.profile)
        reply = pb.CallReply()       # the result is encoded in place: a copy of 9 MB costs the loop ~20 ms
        await self.invoker.call(request, caller, deadlines, plan, reply.value)
        return reply

    async def Call(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.CallReply:  # noqa: N802
        label = "Call"
        try:
            request = read_call(raw, "Call", self.max_request_bytes)
            label = target_label(request.target)
            reply = await self._call(request, context)
            self._refs_trailer(context)
            return reply
        except Exception as exc:
            await abort(context, server_error(exc, label).to_status(), exc)
            raise  # unreachable: abort raises

    async def Stream(self, raw: bytes, context: grpc.aio.ServicerContext) -> None:  # noqa: N802
        label = "Stream"
        try:
            request = read_call(raw, "Stream", self.max_request_bytes)
            label = target_label(request.target)
            opts = parse_metadata(context.invocation_metadata())
            caller = self._caller(context, opts)
            plan = self.invoker.plan(request.target, caller)
            deadlines = resolve_deadlines(opts, context.time_remaining(), plan.profile)
            index = 0
            stall = self.invoker.stall
            items = self.invoker.stream(request, caller, deadlines, opts.stream_interval_s, plan, opts.stream_encoding,
                                        opts.stream_tee)
            async with contextlib.aclosing(items):
                async for item, put in items:
                    out = pb.StreamItem(index=index)
                    put(item, out)
                    # written here rather than yielded, so that a caller who stops reading is noticed
                    await stall.wait(context.write(out), label)
                    index += 1
            self._refs_trailer(context)
        except Exception as exc:
            # A send gRPC refuses has ended the call already: the caller went away, or the item was
            # over the message limit (gRPC itself then ends the call with RESOURCE_EXHAUSTED).
            if not caller_gone(exc):
                await abort(context, server_error(exc, label).to_status(), exc)

    async def Multiplex(self, requests: AsyncIterator[bytes],  # noqa: N802
                        context: grpc.aio.ServicerContext) -> AsyncIterator[bytes]:
        try:
            identity = None if self.trusted else self._identity(context)
            async for reply in multiplex(self.invoker, requests, tuple(context.invocation_metadata() or ()),
                                         context.time_remaining, identity, self.max_request_bytes,
                                         context.peer() or ""):
                yield reply
            self._refs_trailer(context)
        except Exception as exc:
            if not caller_gone(exc):
                await abort(context, server_error(exc, "Multiplex").to_status(), exc)

    async def Collective(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.CollectiveReply:  # noqa: N802
        """A worker on its own is a group of one rank: the call runs once. Pools fan out in the router."""
        label = "Collective"
        try:
            request = self._read(pb.CollectiveRequestView, raw, "Collective")   # calls parsed as Call's are
            calls = collective_calls(request)
            if len(calls) > 1:
                raise BridgeError.validation(
                    f"Collective: this worker is a group of 1 rank, got calls for {len(calls)} ranks",
                    parameter="per_rank")
            call = read_call(calls[0], "Collective", self.max_request_bytes)
            label = target_label(call.target)
            reply = pb.CollectiveReply(results=[await self._call(call, context)])
            self._refs_trailer(context)
            return reply
        except Exception as exc:
            await abort(context, server_error(exc, label).to_status(), exc)
            raise  # unreachable: abort raises

    async def Release(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.ReleaseReply:  # noqa: N802
        try:
            request = read_release(raw, self.max_request_bytes)
            identity = self._identity(context)
            refs = self.invoker.refs
            caller = self._caller(context, parse_metadata(context.invocation_metadata()))
            self.invoker.check_release(list(request.ref_ids), caller.client or caller.identity)
            released = refs.release(list(request.ref_ids), identity)
            if request.session_id:
                # (without authentication, a connection releases what it made in the session: see refs.py)
                released += refs.release_session(request.session_id, identity, connection_of(caller.client))
            if released:
                self.invoker.settle_contexts()
            self._refs_trailer(context)
            return pb.ReleaseReply(released=released)
        except Exception as exc:
            await abort(context, server_error(exc, "Release").to_status(), exc)
            raise  # unreachable: abort raises

    async def Describe(self, raw: bytes, context: grpc.aio.ServicerContext) -> pb.Catalog:  # noqa: N802
        try:
            request = self._read(pb.DescribeRequest, raw, "Describe")
        except Exception as exc:
            await abort(context, server_error(exc, "Describe").to_status(), exc)
            raise  # unreachable: abort raises
        if not request.prefix:
            return self._catalog
        return pb.Catalog(entries=[e for e in self._catalog.entries if e.name.startswith(request.prefix)],
                          vllm_version=self._catalog.vllm_version, bridge_version=self._catalog.bridge_version)


def default_catalog() -> Catalog:
    from adapters.all import SPECS
    return build_catalog(SPECS)


class _StatusService:
    """`Pool/Status` of a lone worker: one pool, "worker", of one worker, this one."""

    def __init__(self, worker: Worker) -> None:
        self._worker = worker

    async def Status(self, request: ppb.StatusRequest, context: grpc.aio.ServicerContext) -> ppb.StatusReply:  # noqa: N802
        return self._worker.status()


@dataclass
class Worker:
    """A built, not yet started worker: its server, services and state."""

    config: WorkerConfig
    server: grpc.aio.Server
    invoker: Invoker
    health: health.aio.HealthServicer
    port: int
    liveness: Liveness
    lane: LaneServer | None = None
    started: float = field(default_factory=time.monotonic)
    ready: bool = False
    watches: HealthWatches = field(default_factory=HealthWatches)
    _tasks: list[asyncio.Task[None]] = field(default_factory=list, init=False)

    async def start(self) -> None:
        """Serves at once (health NOT_SERVING) and reports SERVING once the configured objects exist."""
        for name in ("", SERVICE_NAME):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.config.lane:
            self.lane = await serve_lane(self.invoker, self.config.lane, self.config.max_request_bytes)
        if self.config.distributed is not None:
            await self._join_group(self.config.distributed)
        await self.liveness.create_published()
        eventloop.freeze_heap()
        self.ready = True
        await self.report_health()
        self._tasks = [asyncio.create_task(self._sweep()), asyncio.create_task(self.liveness.run())]
        if self.config.lane is None:
            # reached by strangers directly, as a pool server is: what a burst of large requests left
            # in the heap goes back (one of 32 × 60 MiB Multiplex requests kept 1.1 GB for good)
            self._tasks.append(asyncio.create_task(eventloop.trim_heap()))

    async def report_health(self) -> None:
        serving = self.ready and not self.liveness.detail
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)
        if self.ready:
            log.log(logging.INFO if serving else logging.ERROR, "worker %s: %s", self.invoker.refs.worker_id,
                    "serving" if serving else f"not serving: {self.liveness.detail}")

    def status(self) -> ppb.StatusReply:
        state = ("ready" if not self.liveness.detail else "unhealthy") if self.ready else "starting"
        refs = self.invoker.refs
        worker = ppb.WorkerStatus(id=refs.worker_id, pid=os.getpid(), state=state, address=self.config.listen,
                                  refs=len(refs), sessions=refs.sessions(), uptime_s=time.monotonic() - self.started,
                                  detail=self.liveness.detail, replaced=self.liveness.replaced)
        pool = ppb.PoolStatus(name="worker", state="serving" if state == "ready" else state, workers=[worker],
                              detail=self.liveness.detail)
        return ppb.StatusReply(state=pool.state, pools=[pool], uptime_s=worker.uptime_s, listen=self.config.listen,
                               pid=worker.pid, default_pool="worker")

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
        every = self.config.sweep_every_s
        policy = self.config.policy
        for limit in (policy.unread_request_s, policy.idle_engine_s, policy.orphan_ref_s):
            if limit > 0:     # what expires goes within a quarter of its time
                every = min(every, limit / 4)
        while True:
            await asyncio.sleep(every)
            refs, catalog = self.invoker.refs, self.invoker.catalog
            refs.sweep()
            end_idle_engines(refs, catalog, policy)
            pressed = refs.pressed()
            if pressed or orphan_candidates(refs, policy):
                peers = await asyncio.to_thread(open_peers)     # the kernel takes ms to list them
                if peers is not None:
                    end_orphans(refs, catalog, policy, peers, pressed=pressed)
            self.invoker.settle_contexts()

    async def stop(self, grace_s: float | None = None) -> None:
        """Stops taking calls, lets in-flight ones finish within the grace period, then releases refs."""
        await self.health.enter_graceful_shutdown()
        await self.watches.end()
        grace = self.config.grace_s if grace_s is None else grace_s
        await asyncio.gather(self.server.stop(grace), *([self.lane.stop(grace)] if self.lane else []))
        for task in self._tasks:
            task.cancel()
        self.invoker.refs.close()
        for obj in self.invoker.objects.values():
            self.invoker.catalog.finalize(obj)
        self.invoker.close()


def build_worker(config: WorkerConfig, catalog: Catalog | None = None,
                 objects: dict[str, object] | None = None) -> Worker:
    security = config.security
    check_exposure(config.listen, security, config.insecure, "vllm-bridge worker")
    worker_id = config.worker_id or f"w{os.getpid()}"
    catalog = catalog or default_catalog()
    def finalize(obj: object) -> None:
        """The last client ref to obj is gone. What the worker publishes is the server's, whatever
        refs clients got to it (a result may be the published engine itself): it lives on."""
        if not invoker.publishes(obj):
            catalog.finalize(obj)

    refs = RefRegistry(worker_id, session_cap=config.session_cap, idle_ttl_s=config.idle_ttl_s,
                       finalize=finalize, max_sessions=config.max_sessions,
                       max_refs_per_client=config.max_refs_per_client,
                       max_ref_bytes_per_client=config.max_ref_bytes_per_client, files_cap=files_cap,
                       files_open=open_files)
    invoker = Invoker(catalog, refs, objects=dict(objects or {}), tensor_max_bytes=config.tensor_max_bytes,
                      shared_threads=config.shared_threads, distributed=config.distributed is not None,
                      world_size=config.distributed.world_size if config.distributed is not None else 1,
                      policy=config.policy, limits=config.limits)
    # Beyond gRPC's own limit, a request is refused by the handlers, which name max_request_bytes.
    limit = config.max_request_bytes + 64 * 1024
    options = [o for o in server_options(config.min_ping_interval_s) if o[0] != "grpc.max_receive_message_length"]
    # A worker of a pool is reached over a private socket by its pool server only, which bounds what
    # it reads for its callers; a worker on its own reads within the same bounds (`receiving.py`).
    gate = [] if config.lane is not None else [ReceiveGate(ReceiveLimits.for_requests(
        config.max_request_bytes, DEFAULT_RECEIVING_BYTES), identify=security.identify_token)]
    server = grpc.aio.server(options=[*options, ("grpc.max_receive_message_length", limit),
                                      *(UNCOMPRESSED_REQUESTS if gate else []), *config.extra_options],
                             interceptors=[*gate, *security.interceptors()])
    # A supervised worker (it serves a lane, on a socket only its supervisor can reach) without
    # tokens of its own takes the pool server's word for who each call is for.
    trusted = config.lane is not None and security.tokens is None
    server.add_generic_rpc_handlers([BridgeService(invoker, security, trusted, config.max_request_bytes).handler()])
    health_servicer = health.aio.HealthServicer()
    server.add_generic_rpc_handlers([reflection_service(
        (SERVICE_NAME, POOL_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))])
    port = security.add_port(server, config.listen)
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    published = [ObjectConfig(o["name"], o["target"], from_json(o.get("args", [])), from_json(o.get("kwargs", {})))
                 for o in config.objects]
    holder: list[Worker] = []
    liveness = Liveness(invoker, published, lambda: holder[0].report_health(), interval_s=config.probe_interval_s,
                        probe_timeout_s=config.probe_timeout_s, warmup=config.warmup)
    invoker.adopt = liveness.adopt
    worker = Worker(config, server, invoker, health_servicer, port, liveness)
    holder.append(worker)
    server.add_generic_rpc_handlers(health_and_status(health_servicer, _StatusService(worker).Status, worker.watches))
    return worker


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
