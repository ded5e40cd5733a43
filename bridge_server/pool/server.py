"""The pool server process: the one address Elixir apps talk to.

It serves `Bridge` (forwarded to the workers by the router), `Pool.Status`, grpc.health.v1 (overall,
and one service per pool, "pool/<name>") and server reflection, plus Prometheus metrics over HTTP,
on the configured event loop (uvloop by default, see wire/eventloop.py).
It owns the order of things: listen first (health NOT_SERVING), start every worker, report SERVING;
on SIGTERM/SIGINT stop taking calls, give in-flight ones the grace period, then stop every worker.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import signal
import time

import grpc
from grpc_health.v1 import health, health_pb2

from bridge_server.pool.backlog import Backlog
from bridge_server.pool.config import ServerConfig
from bridge_server.pool.forward import SERVICE, Forwarder
from bridge_server.pool.metrics import Metrics, PoolSnapshot
from bridge_server.pool.router import Router
from bridge_server.pool.supervisor import Supervisor
from bridge_server.wire import eventloop
from bridge_server.wire.errors import abort, quote, status_of
from bridge_server.wire.open_services import HealthWatches, health_and_status, reflection_service
from bridge_server.wire.protocol import connection_limit, public_server_options
from bridge_server.wire.receiving import ReceiveGate, ReceiveLimits
from bridge_server.wire.security import ServerSecurity, check_exposure
from vllm_bridge.v1 import pool_pb2 as ppb

log = logging.getLogger("vllm_bridge.server")

POOL_SERVICE = ppb.DESCRIPTOR.services_by_name["Pool"].full_name
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def pool_health_service(pool: str) -> str:
    """The grpc.health.v1 service name that reports one pool."""
    return f"pool/{pool}"


def open_files() -> int:
    """The pool server's limit on open files (each client connection takes one), raised first as far
    as the system lets a process raise its own."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = 1 << 20 if hard == resource.RLIM_INFINITY else hard
    if soft != resource.RLIM_INFINITY and soft < want:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            soft = want
        except (ValueError, OSError):
            pass
    return soft if soft != resource.RLIM_INFINITY else 1 << 20


class _StatusService:
    def __init__(self, server: PoolServer) -> None:
        self._server = server

    async def Status(self, request: ppb.StatusRequest, context: grpc.aio.ServicerContext) -> ppb.StatusReply:  # noqa: N802
        if request.pool and request.pool not in self._server.router.pools:
            # the name as far as it helps: a status fits a header
            pools = ", ".join(self._server.router.pools)
            await abort(context, status_of(grpc.StatusCode.NOT_FOUND, f"no pool {quote(request.pool)}; pools: {pools}"))
        return self._server.status(request.pool)


class PoolServer:
    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = Metrics()
        self.router = Router(config.pools, config.default_pool_name)
        for name, pool in self.router.pools.items():
            pool.observe_wait = self.metrics.queue_wait.labels(name).observe
            self.metrics.restarts.labels(name)      # exported as 0 from the start, not from the first crash
            self.metrics.recycles.labels(name)
        self.supervisor = Supervisor(config, self.router, self.metrics, self._changed)
        self.metrics.watch(self._snapshot)
        self.health = health.aio.HealthServicer()
        security = ServerSecurity.load(config.token_file or None, config.tls_cert or None, config.tls_key or None,
                                       config.tls_client_ca or None, open_services=not config.auth_health)
        check_exposure(config.listen, security, config.insecure, "vllm-bridge serve")
        # Beyond gRPC's own limit, a request is refused by the forwarder, which names max_request_bytes.
        self.max_connections = config.max_connections or connection_limit(open_files())
        options = [o for o in public_server_options(config.min_ping_interval_s, self.max_connections)
                   if o[0] != "grpc.max_receive_message_length"]
        self.server = grpc.aio.server(options=[*options, ("grpc.max_receive_message_length",
                                                          config.max_request_bytes + 64 * 1024)],
                                      interceptors=[ReceiveGate(ReceiveLimits.for_requests(
                                          config.max_request_bytes, config.max_receiving_bytes, config.receive_s,
                                          config.streams_per_host, config.stall_s), identify=security.identify_token),
                                          *security.interceptors()])
        self.backlog = backlog = Backlog(config.max_unread_bytes)
        self.metrics.watch_unread(lambda: (backlog.total, backlog.ended, backlog.refused))
        self.server.add_generic_rpc_handlers([Forwarder(self.router, self.metrics, security,
                                                        config.max_request_bytes, self.backlog).handler()])
        self.watches = HealthWatches()
        self.server.add_generic_rpc_handlers(health_and_status(self.health, _StatusService(self).Status, self.watches))
        self.server.add_generic_rpc_handlers([reflection_service(
            (SERVICE, POOL_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name))])
        self.port = security.add_port(self.server, config.listen)
        if self.port == 0:
            raise OSError(f"cannot listen on {config.listen}")
        self.metrics_port = 0
        self.state = "starting"
        self.started = time.monotonic()
        self._trimming: asyncio.Task[None] | None = None     # `eventloop.trim_heap`, once serving
        self._health_task: asyncio.Task[None] | None = None
        self._health_dirty = False

    # ------------------------------------------------------------------------------------ health
    def _changed(self) -> None:
        """Something changed in a pool: refresh health (coalesced: one refresh at a time)."""
        self._health_dirty = True
        if self._health_task is None or self._health_task.done():
            self._health_task = asyncio.get_running_loop().create_task(self._refresh_health())

    async def _refresh_health(self) -> None:
        while self._health_dirty:
            self._health_dirty = False
            if self.state == "stopping":
                return
            states = {name: p.state for name, p in self.supervisor.pools.items()}
            for name, state in states.items():
                await self.health.set(pool_health_service(name), SERVING if state == "serving" else NOT_SERVING)
            overall = SERVING if self.state == "serving" and all(s == "serving" for s in states.values()) else NOT_SERVING
            for name in ("", SERVICE):
                await self.health.set(name, overall)

    # ------------------------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        for name in ("", SERVICE, *(pool_health_service(p) for p in self.router.pools)):
            await self.health.set(name, NOT_SERVING)
        await self.server.start()
        if self.config.metrics_port:
            self.metrics_port = self.metrics.serve(self.config.metrics_port, self.config.metrics_host)
        log.info("listening on %s (port %d, %s loop); starting %d pool(s)", self.config.listen, self.port,
                 eventloop.loop_name(asyncio.get_running_loop()), len(self.config.pools))
        await self.supervisor.start()
        eventloop.freeze_heap()
        eventloop.return_large_buffers()    # not in workers: their engines' tensors would pay for it
        self._trimming = asyncio.get_running_loop().create_task(eventloop.trim_heap())
        self.state = "serving"
        self._changed()
        log.info("serving: %s", ", ".join(f"{n} ({p.state})" for n, p in self.supervisor.pools.items()))

    async def shutdown(self) -> None:
        """Stop taking calls, let in-flight ones finish within the grace period, stop every worker."""
        log.info("shutting down: in-flight calls get %.1f s", self.config.grace_s)
        self.state = "stopping"
        if self._trimming is not None:
            self._trimming.cancel()
        await self.health.enter_graceful_shutdown()
        await self.watches.end()
        self.router.accepting = False
        try:
            await self.server.stop(self.config.grace_s)
            await self.supervisor.stop()
        finally:
            self.supervisor.kill_all()
            self.metrics.close()
        log.info("stopped")

    # ------------------------------------------------------------------------------------ status
    def _snapshot(self) -> list[PoolSnapshot]:
        out = []
        for name, ps in self.supervisor.pools.items():
            pr = self.router.pools[name]
            states: dict[str, int] = {}
            for wp in ps.procs:
                states[wp.state] = states.get(wp.state, 0) + 1
            out.append((name, len(pr.queue), sum(b.in_flight for b in pr.backends), len(pr.sessions), states,
                        pr.stalled_streams()))
        return out

    def status(self, only: str = "") -> ppb.StatusReply:
        now = time.monotonic()
        reply = ppb.StatusReply(state=self.state, uptime_s=now - self.started, listen=self.config.listen,
                                pid=os.getpid(), default_pool=self.router.default_pool)
        if self.state == "serving" and any(p.state == "degraded" for p in self.supervisor.pools.values()):
            reply.state = "degraded"
        for name, ps in self.supervisor.pools.items():
            if only and name != only:
                continue
            pr = self.router.pools[name]
            cfg = ps.config
            pool = reply.pools.add(name=name, state=ps.state, affinity=cfg.affinity, max_concurrent=cfg.max_concurrent,
                                   queue_length=len(pr.queue), queue_capacity=cfg.queue_size, restarts=ps.restarts,
                                   sessions=len(pr.sessions), in_flight=sum(b.in_flight for b in pr.backends),
                                   detail=ps.degraded or pr.unavailable, stalled_streams=pr.stalled_streams())
            for slot in ps.slots:
                procs = [wp for wp in ps.procs if wp.index == slot.index]
                for wp in procs:
                    b = wp.backend
                    pool.workers.add(id=wp.id, index=slot.index, generation=wp.generation, pid=wp.pid, state=wp.state,
                                     address=wp.address, in_flight=b.in_flight if b else 0,
                                     max_concurrent=cfg.max_concurrent, calls=b.calls if b else 0,
                                     sessions=b.sessions if b else 0, refs=b.refs if b else -1,
                                     uptime_s=now - wp.started, restarts=slot.restarts, last_exit=slot.last_exit,
                                     detail=wp.detail, replaced=wp.replaced)
                if not procs:
                    pool.workers.add(id=slot.last_id, index=slot.index, generation=slot.generation, state=slot.state,
                                     max_concurrent=cfg.max_concurrent, refs=-1, restarts=slot.restarts,
                                     last_exit=slot.last_exit)
        return reply


async def serve(config: ServerConfig, ready_file: str | None = None, stdin_watch: bool = False) -> None:
    """Runs the pool server until SIGTERM or SIGINT (or, with `stdin_watch`, until its stdin closes),
    then shuts down gracefully."""
    srv = PoolServer(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if stdin_watch:
        _stop_when_stdin_closes(loop, stop)
    try:
        starting = loop.create_task(srv.start())
        stopping = loop.create_task(stop.wait())
        await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if starting.done():
            starting.result()
            if ready_file:
                with open(ready_file + ".tmp", "w") as f:
                    f.write(str(srv.port))
                os.replace(ready_file + ".tmp", ready_file)
            await stopping
        else:
            starting.cancel()
        await srv.shutdown()
    finally:
        srv.supervisor.kill_all()


def _stop_when_stdin_closes(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """For a parent that runs the server through a pipe (an Elixir Port): when the parent dies, even
    by SIGKILL, the pipe closes and the server stops as on SIGTERM, its workers and their engine
    cores with it. Its own parent-death signal (SIGTERM) covers a parent whose pipe outlives it."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)   # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass

    def readable() -> None:
        try:
            data = os.read(0, 65536)
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(0)
            log.warning("stdin closed (--stdin-watch): stopping")
            stop.set()

    loop.add_reader(0, readable)


def run(config: ServerConfig, ready_file: str | None = None, stdin_watch: bool = False) -> int:
    eventloop.run(serve(config, ready_file, stdin_watch), config.loop)
    return 0
