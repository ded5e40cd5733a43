"""The supervisor: starts, watches, restarts, recycles and stops the worker processes of every pool.

Starting one process and knowing when it is ready is `workerproc.py`'s job; this module decides when
and why. Every worker of every pool starts at once; one counts as ready once its grpc.health.v1 check
passes, and then the router is told about it.

An exit watcher per process reacts the moment the process ends: it kills the rest of its process
group (vLLM's engine-core children), fails its in-flight calls ("worker crashed") through the router,
and records the crash.

A live worker is watched too. Its health (grpc.health.v1 Watch) says when it cannot serve (a
published engine being created again, a call stuck in its exclusive lane): it then takes no new
calls, its reason (from its own Pool/Status) shows in the status, and the pool fails calls at once
with that reason when no worker can take them; a worker that stays so for `unhealthy_timeout_s` is
replaced, and a rank of a distributed pool restarts the group at once. A worker that cannot say
anything (its event loop blocked) is found by a health check of the supervisor's own every
`probe_interval_s`: two unanswered make it unhealthy, `HANG_PROBES` replace it. A lane that closes
while its worker lives is opened again; if it cannot be, the worker is replaced. Each pool slot then restarts its worker with exponential backoff; more than
`max_restarts` crashes of a pool within `restart_window_s` mark it degraded, and it stops restarting
rather than loop, but for one fresh try of its failed workers every `degraded_retry_s`.

Recycling (after a number of calls or a lifetime) starts the replacement first, then drains the old
worker (no new calls except those bound to it by refs or strict sessions) until its calls are done
and its refs released, within `drain_timeout_s`, and stops it.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import shutil
import socket
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.pool.config import PoolConfig, ServerConfig
from bridge_server.pool.forward import make_stubs, release_on
from bridge_server.pool.lane import open_lane
from bridge_server.pool.metrics import Metrics
from bridge_server.pool.poolstate import DEAD, DRAINING, READY, RECONNECTING, UNHEALTHY, Backend
from bridge_server.pool.router import Router
from bridge_server.pool.workerproc import (
    EXITED,
    STARTING,
    STOPPING,
    WorkerProc,
    describe_exit,
    kill_group,
    spawn,
    terminate,
    wait_ready,
)
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import pool_pb2 as ppb
from vllm_bridge.v1 import pool_pb2_grpc as ppb_grpc

log = logging.getLogger("vllm_bridge.supervisor")

BACKOFF, FAILED = "backoff", "failed"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(eq=False)
class Slot:
    """A place in a pool for one worker; its process changes across restarts and recycles."""

    index: int
    generation: int = 0
    state: str = STARTING
    restarts: int = 0
    last_id: str = ""
    last_exit: str = ""
    crashes: deque[float] = field(default_factory=deque)
    settled: asyncio.Event = field(default_factory=asyncio.Event)   # first worker ready, or given up
    task: asyncio.Task[None] | None = None


# ------------------------------------------------------------------------------------ draining
# A drained worker still takes calls on its refs (the router sends those nowhere else), so the wait
# before stopping it is for its in-flight calls and for its live refs: a ref is state a client still
# means to use, and stopping the worker would turn it into "worker lost". A client may never release,
# so the wait is bounded; what it leaves behind is said in the worker's exit description, which the
# router's "worker lost" errors quote.
REF_POLL_S = 0.5     # how often a worker with no calls left is asked for its live refs
HANG_PROBES = 4      # health checks in a row a worker leaves unanswered before it is replaced


async def refs_held(backend: Backend) -> int | None:
    """The refs the worker holds now, asked of the worker itself, since refs also go by idle TTL
    unseen by the router; None when it does not answer."""
    try:
        await release_on(backend, pb.ReleaseRequest(), (), REF_POLL_S * 4)
    except grpc.aio.AioRpcError:
        return None
    return backend.refs


async def drain(backend: Backend, exited: asyncio.Event, timeout_s: float) -> str:
    """Waits until the worker has no calls and no refs, has exited, or `timeout_s` has passed;
    returns why it stops, for its exit description."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not exited.is_set():
        if not backend.in_flight and await refs_held(backend) == 0:
            break
        await asyncio.sleep(0.05 if backend.in_flight else REF_POLL_S)
    if backend.refs > 0 and not exited.is_set():
        why = (f"recycled with {backend.refs} live ref{'s' if backend.refs > 1 else ''} "
               f"after drain_timeout_s {timeout_s:g} s")
        log.warning("pool %s: worker %s %s; calls that use them will fail with 'worker lost'", backend.pool,
                    backend.id, why)
        return why
    return "recycled"


class PoolSupervisor:
    def __init__(self, config: PoolConfig, router: Router, sockets_dir: str, metrics: Metrics,
                 on_change: Callable[[], None], max_request_bytes: int = 64 * 1024 * 1024) -> None:
        self.config = config
        self.max_request_bytes = max_request_bytes
        self.name = config.name
        self.router = router
        self.sockets_dir = sockets_dir
        self.metrics = metrics
        self.on_change = on_change
        self.slots = [Slot(i) for i in range(config.workers)]
        self.procs: list[WorkerProc] = []
        self.crashes: deque[float] = deque()
        self.degraded = ""
        self.degraded_at = 0.0       # when it was degraded, or last tried again
        self.stopping = False
        self._stopping = asyncio.Event()
        self._seq = 0
        self._tasks: set[asyncio.Task[None]] = set()
        # A distributed pool is one torch.distributed group: every start of the group rendezvouses
        # on a fresh port, and losing any rank restarts the whole group.
        self.group_port = _free_port() if config.distributed else 0
        self.regrouping = ""
        router.pools[self.name].restart_group = self.restart_group

    # ------------------------------------------------------------------------------------ state
    @property
    def state(self) -> str:
        if self.stopping:
            return "stopping"
        if self.degraded:
            return "degraded"
        if self.config.distributed is not None:
            if self.regrouping:
                return "regrouping"
            if all(s.state == READY for s in self.slots) and all(p.state == READY for p in self.procs):
                return "serving"
            return "starting"
        if any(p.state == READY for p in self.procs):
            return "serving"
        return "unhealthy" if any(p.state in (UNHEALTHY, RECONNECTING) for p in self.procs) else "starting"

    def restart_group(self, reason: str) -> None:
        """A group cannot continue with a missing or stuck rank: stop every rank, start them all again."""
        if self.config.distributed is None or self.stopping:
            return
        log.error("pool %s: restarting the whole group: %s", self.name, reason)
        self.group_port = _free_port()
        self.regrouping = reason
        for wp in list(self.procs):
            if not wp.exited.is_set():
                wp.expected_exit = True
                wp.exit_description = f"stopped to restart the group ({reason})"
                kill_group(wp.pid)
        self._changed()

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self.slots)

    def _task(self, coro: Any) -> None:
        t: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        for slot in self.slots:
            slot.task = asyncio.get_running_loop().create_task(self._run_slot(slot))
        if self.config.recycle_after_calls or self.config.recycle_after_s:
            self._task(self._recycle_check())
        if self.config.degraded_retry_s:
            self._task(self._retry_when_degraded())

    async def wait_settled(self) -> None:
        await asyncio.gather(*(s.settled.wait() for s in self.slots))

    async def _run_slot(self, slot: Slot) -> None:
        try:
            while not self.stopping:
                wp = await self._launch(slot)
                if wp.state == READY:
                    slot.settled.set()
                    wp = await self._serve(slot, wp)
                await wp.exited.wait()
                if self.stopping:
                    return
                if self.degraded:
                    slot.state = FAILED
                    slot.settled.set()
                    self._changed()
                    return
                delay = min(self.config.restart_backoff_s * 2 ** max(0, len(slot.crashes) - 1),
                            self.config.restart_backoff_max_s)
                slot.state = BACKOFF
                self._changed()
                log.warning("pool %s: restarting worker %d in %.2f s (%s)", self.name, slot.index, delay, slot.last_exit)
                await asyncio.sleep(delay)
                slot.restarts += 1
                self.metrics.restarts.labels(self.name).inc()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("pool %s: supervising worker slot %d failed", self.name, slot.index)
            slot.state = FAILED
            slot.settled.set()

    async def _serve(self, slot: Slot, wp: WorkerProc) -> WorkerProc:
        """Watches a ready worker until it exits; replaces it when it is due for recycling."""
        while True:
            waits = [asyncio.ensure_future(wp.exited.wait()), asyncio.ensure_future(wp.recycle.wait())]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if wp.exited.is_set() or self.stopping:
                return wp
            new = await self._launch(slot)      # make before break: the old one serves meanwhile
            if new.state != READY:
                wp.recycle.clear()
                await asyncio.sleep(self.config.restart_backoff_s)
                continue
            self.metrics.recycles.labels(self.name).inc()
            self._task(self._retire(wp))
            wp = new

    async def _launch(self, slot: Slot) -> WorkerProc:
        """Spawns a worker and waits for its health check; returns it READY, or exited."""
        slot.generation += 1
        self._seq += 1
        wp = WorkerProc(f"{self.name}-{slot.index}-g{slot.generation}", self.name, slot.index, slot.generation,
                        os.path.join(self.sockets_dir, f"{self.name[:40]}-{self._seq}.sock"))
        slot.last_id = wp.id
        slot.state = STARTING
        d = self.config.distributed
        if d is not None:
            wp.extra_args = d.worker_args(slot.index, self.config.workers, f"tcp://127.0.0.1:{self.group_port}")
        self.procs.append(wp)
        self._changed()
        try:
            await spawn(wp, self.config, self.max_request_bytes)
        except OSError as exc:
            wp.exit_description = f"could not start: {exc}"
            slot.last_exit = wp.exit_description
            if exc.errno not in (errno.EMFILE, errno.ENFILE, errno.ENOMEM, errno.EAGAIN):
                self._note_crash(slot, wp)      # else the pool server's own shortage: tried again, no crash
            self.procs.remove(wp)
            wp.state = EXITED
            wp.exited.set()
            return wp
        self._task(self._watch(wp, slot))
        channel = await wait_ready(wp, self.config.start_timeout_s, self._stopping)
        if channel is None or wp.exited.is_set():      # failed, or died right after its health check
            if channel is not None:
                await channel.close()
            await wp.exited.wait()
            return wp
        try:
            lane = await open_lane(wp.lane_path)
        except OSError as exc:
            wp.exit_description = f"its lane ({wp.lane_path}) refused the connection: {exc}"
            kill_group(wp.pid)
            await channel.close()
            await wp.exited.wait()
            return wp
        wp.state = READY
        slot.state = READY
        if self.regrouping and all(s.state == READY for s in self.slots):
            log.info("pool %s: the group is back (%s)", self.name, self.regrouping)
            self.regrouping = ""
        wp.backend = Backend(wp.id, self.name, wp.address, self.config.max_concurrent, slot.index, channel,
                             make_stubs(channel), lane=lane)
        lane.on_closed = functools.partial(self._lane_closed, wp)
        self.router.add_backend(wp.backend)
        wp.health_watch = asyncio.get_running_loop().create_task(self._watch_health(wp))
        log.info("pool %s: worker %s ready (pid %d) in %.1f s", self.name, wp.id, wp.pid, time.monotonic() - wp.started)
        if self.degraded and (self.config.distributed is None or all(s.state == READY for s in self.slots)):
            log.warning("pool %s recovered: %s started again after the pool was degraded (%s)", self.name, wp.id,
                        self.degraded)
            self.degraded = ""
            self.crashes.clear()
            self.router.pools[self.name].set_unavailable("")
        self._changed()
        return wp

    async def _watch(self, wp: WorkerProc, slot: Slot) -> None:
        """Runs the moment the process ends: nothing of it may survive, none of its calls may hang."""
        assert wp.proc is not None
        rc = await wp.proc.wait()
        kill_group(wp.pid)       # vLLM's engine-core children and anything else in its group
        if wp.health_watch is not None:
            wp.health_watch.cancel()
        desc = describe_exit(rc)
        if wp.exit_description:
            desc = f"{wp.exit_description}; {desc}"
        wp.exit_description = desc
        wp.state = EXITED
        slot.last_exit = f"{wp.id} {desc}"
        if wp in self.procs:
            self.procs.remove(wp)
        if wp.backend is not None:
            reason = "worker stopped" if wp.expected_exit else "worker crashed"
            self.router.remove_backend(wp.backend, reason, f"worker {wp.id} {desc}")
            wp.backend.lane.close()
            self._task(wp.backend.channel.close())
        if not wp.expected_exit:
            log.error("pool %s: worker %s (pid %d) %s", self.name, wp.id, wp.pid, desc)
            self._note_crash(slot, wp)
            self.restart_group(f"rank {slot.index} ({wp.id}) {desc}")
        wp.exited.set()
        self._changed()

    # ------------------------------------------------------------------------------------ a live worker
    def _lane_closed(self, wp: WorkerProc, reason: str) -> None:
        b = wp.backend
        if wp.exited.is_set() or self.stopping or b is None or b.state in (DEAD, DRAINING) or wp.state != READY:
            return      # the worker is going away (its exit watcher handles it)
        log.error("pool %s: worker %s: its lane closed (%s); opening it again", self.name, wp.id, reason)
        b.state = wp.state = RECONNECTING
        self._changed()
        self._task(self._reopen_lane(wp, reason))

    async def _reopen_lane(self, wp: WorkerProc, reason: str) -> None:
        b = wp.backend
        assert b is not None
        for delay in (0.0, 0.2, 1.0):
            await asyncio.sleep(delay)
            if wp.exited.is_set() or self.stopping:
                return
            try:
                lane = await open_lane(wp.lane_path)
            except OSError as exc:
                log.warning("pool %s: worker %s: reopening its lane failed: %s", self.name, wp.id, exc)
                continue
            lane.on_closed = functools.partial(self._lane_closed, wp)
            b.lane = lane
            b.state = wp.state = READY if not wp.detail else UNHEALTHY
            log.warning("pool %s: worker %s: its lane is open again", self.name, wp.id)
            self._changed()
            self.router.pools[self.name].dispatch()
            return
        wp.exit_description = f"its lane closed ({reason}) and could not be opened again"
        kill_group(wp.pid)

    async def _watch_health(self, wp: WorkerProc) -> None:
        """Follows the worker's health for as long as it lives: what it says (Watch pushes), and
        whether it answers at all (a worker whose event loop is blocked, by C code that holds the
        GIL say, pushes nothing and would go on looking healthy)."""
        await asyncio.gather(self._follow_health(wp), self._probe_health(wp))

    async def _probe_health(self, wp: WorkerProc) -> None:
        """A health check every probe_interval_s. Two unanswered in a row (probe_timeout_s each):
        the worker is unhealthy (no call goes to it); no answer for HANG_PROBES intervals and
        timeouts: it is replaced, as if it had crashed."""
        b = wp.backend
        assert b is not None
        stub = health_pb2_grpc.HealthStub(b.channel)
        interval, timeout = self.config.probe_interval_s, self.config.probe_timeout_s
        misses, answered = 0, time.monotonic()
        while not wp.exited.is_set() and not self.stopping:
            await asyncio.sleep(interval)
            if wp.exited.is_set() or self.stopping or wp.state not in (READY, UNHEALTHY):
                misses, answered = 0, time.monotonic()
                continue
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=timeout)
            except grpc.aio.AioRpcError:
                misses += 1
            else:
                serving = reply.status == health_pb2.HealthCheckResponse.SERVING
                if misses >= 2:
                    log.warning("pool %s: worker %s answers its health check again", self.name, wp.id)
                    wp.detail = ""
                    await self._health_changed(wp, serving)
                elif not serving and wp.state == UNHEALTHY:
                    # health's Watch says only a change of status: why it is not serving may change meanwhile
                    # (a core stopped by a signal, then found dead and being created again)
                    await self._refresh_detail(wp)
                misses, answered = 0, time.monotonic()
                continue
            silent = time.monotonic() - answered
            if misses == 2:
                wp.detail = f"it answered no health check for {silent:.0f} s: its event loop is blocked"
                await self._health_changed(wp, False)
            elif misses >= HANG_PROBES:
                wp.exit_description = f"replaced: it answered no health check for {silent:.0f} s"
                log.error("pool %s: worker %s %s", self.name, wp.id, wp.exit_description)
                kill_group(wp.pid)
                return

    async def _follow_health(self, wp: WorkerProc) -> None:
        b = wp.backend
        assert b is not None
        stub = health_pb2_grpc.HealthStub(b.channel)
        while not wp.exited.is_set() and not self.stopping:
            try:
                async for reply in stub.Watch(health_pb2.HealthCheckRequest()):
                    await self._health_changed(wp, reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.aio.AioRpcError:
                pass
            await asyncio.sleep(0.5)      # the stream broke: the worker is going, or will answer again

    async def _health_changed(self, wp: WorkerProc, serving: bool) -> None:
        b = wp.backend
        if b is None or wp.exited.is_set() or b.state in (DEAD, DRAINING) or wp.state in (DRAINING, STOPPING):
            return
        if serving:
            if wp.state == UNHEALTHY:
                log.warning("pool %s: worker %s serves again (%s)", self.name, wp.id, wp.detail)
                wp.detail = ""
                b.state = wp.state = READY
                await self._refresh_detail(wp)
                self._changed()
                self.router.pools[self.name].dispatch()
            return
        await self._refresh_detail(wp)
        if wp.state == UNHEALTHY:
            return
        b.state = wp.state = UNHEALTHY
        wp.detail = wp.detail or "it reports NOT_SERVING"
        log.error("pool %s: worker %s is not serving: %s", self.name, wp.id, wp.detail)
        self._changed()
        if self.config.distributed is not None:
            self.restart_group(f"rank {wp.index} ({wp.id}) is not serving: {wp.detail}")
        elif self.config.unhealthy_timeout_s:
            self._task(self._replace_if_still_unhealthy(wp))

    async def _refresh_detail(self, wp: WorkerProc) -> None:
        """Why the worker is not serving, as it says itself."""
        b = wp.backend
        assert b is not None
        try:
            reply = await ppb_grpc.PoolStub(b.channel).Status(ppb.StatusRequest(), timeout=2.0)
            me = reply.pools[0].workers[0]
            wp.detail, wp.replaced = me.detail, me.replaced
        except (grpc.aio.AioRpcError, IndexError):
            pass

    async def _replace_if_still_unhealthy(self, wp: WorkerProc) -> None:
        since = time.monotonic()
        while time.monotonic() - since < self.config.unhealthy_timeout_s:
            await asyncio.sleep(min(1.0, self.config.unhealthy_timeout_s))
            if wp.exited.is_set() or wp.state != UNHEALTHY:
                return
        wp.exit_description = (f"replaced: not serving for {self.config.unhealthy_timeout_s:g} s "
                               f"(unhealthy_timeout_s; {wp.detail})")
        log.error("pool %s: worker %s %s", self.name, wp.id, wp.exit_description)
        kill_group(wp.pid)

    def _changed(self) -> None:
        """Something changed in the pool: calls that no worker can take now fail at once, saying why
        (a degraded or stopping pool says so itself), and the server's health is refreshed."""
        if not self.stopping and not self.degraded:
            troubled = [wp for wp in self.procs if wp.state in (UNHEALTHY, RECONNECTING)]
            serving = any(wp.state == READY for wp in self.procs)
            why = "; ".join(f"worker {wp.id} is {wp.state}" + (f" ({wp.detail})" if wp.detail else "")
                            for wp in troubled)
            self.router.pools[self.name].set_unavailable("" if serving or not troubled else why)
        self.on_change()

    def _note_crash(self, slot: Slot, wp: WorkerProc) -> None:
        now = time.monotonic()
        window = self.config.restart_window_s
        for q in (slot.crashes, self.crashes):
            q.append(now)
            while q and q[0] < now - window:
                q.popleft()
        if len(self.crashes) > self.config.max_restarts and not self.degraded and not self.stopping:
            self.degraded = (f"{len(self.crashes)} worker crashes within {window:g} s (max_restarts "
                             f"{self.config.max_restarts}); last: {wp.id} {wp.exit_description}")
            self.degraded_at = now
            retry = self.config.degraded_retry_s
            log.error("pool %s degraded: %s; %s", self.name, self.degraded,
                      f"its failed workers are tried again every {retry:g} s" if retry else "it stays so")
            self.router.pools[self.name].set_unavailable(f"the pool is degraded: {self.degraded}")

    async def _retry_when_degraded(self) -> None:
        """A degraded pool tries its failed workers again every `degraded_retry_s`: what made them
        crash (a full disk, a port or a device held by another job, a model being replaced) may be
        gone, and healing a pool should not need a restart of the server and all its other pools.
        A try is one start per failed worker; a crash in it leaves the pool degraded until the next."""
        retry = self.config.degraded_retry_s
        while not self.stopping:
            await asyncio.sleep(min(1.0, retry))
            if not self.degraded or self.stopping or time.monotonic() - self.degraded_at < retry:
                continue
            failed = [s for s in self.slots if s.state == FAILED and (s.task is None or s.task.done())]
            if not failed:
                continue
            self.degraded_at = time.monotonic()
            log.warning("pool %s: degraded for %g s; starting %d failed worker(s) again", self.name, retry, len(failed))
            if self.config.distributed is not None:
                self.group_port = _free_port()
            for slot in failed:
                slot.crashes.clear()
                slot.restarts += 1
                self.metrics.restarts.labels(self.name).inc()
                slot.task = asyncio.get_running_loop().create_task(self._run_slot(slot))

    async def _recycle_check(self) -> None:
        cfg = self.config
        while not self.stopping:
            await asyncio.sleep(0.5)
            if self.degraded:
                continue
            now = time.monotonic()
            for wp in self.procs:
                b = wp.backend
                if wp.state == READY and b is not None and b.state == READY and (
                        (cfg.recycle_after_calls and b.calls >= cfg.recycle_after_calls)
                        or (cfg.recycle_after_s and now - wp.started >= cfg.recycle_after_s)):
                    wp.recycle.set()

    async def _retire(self, wp: WorkerProc) -> None:
        """Drains a recycled worker (its calls done, its refs released: `drain`), then stops it."""
        b = wp.backend
        if b is not None:
            b.state = DRAINING
            wp.state = DRAINING
            self._changed()
            wp.exit_description = await drain(b, wp.exited, self.config.drain_timeout_s)
        await self.stop_proc(wp)

    async def stop_proc(self, wp: WorkerProc) -> None:
        if wp.health_watch is not None:
            wp.health_watch.cancel()         # an open Watch would hold the worker's graceful stop
        if wp.backend is not None:
            wp.backend.state = DRAINING      # no new calls while it stops
        await terminate(wp, self.config.worker_grace_s)

    async def stop(self) -> None:
        self.stopping = True
        self._stopping.set()
        self.router.pools[self.name].set_unavailable("the server is shutting down")
        for slot in self.slots:
            if slot.task is not None:
                slot.task.cancel()
        await asyncio.gather(*(self.stop_proc(wp) for wp in list(self.procs)), return_exceptions=True)
        for t in list(self._tasks):
            t.cancel()

    def kill_all(self) -> None:
        """Last resort, synchronous: no process of ours survives the server."""
        for wp in list(self.procs):
            if wp.pid:
                kill_group(wp.pid)


class Supervisor:
    """Every pool's supervisor, and the directory of the workers' sockets."""

    def __init__(self, config: ServerConfig, router: Router, metrics: Metrics, on_change: Callable[[], None]) -> None:
        self.sockets_dir = tempfile.mkdtemp(prefix="vllm-bridge-")
        self.pools = {p.name: PoolSupervisor(p, router, self.sockets_dir, metrics, on_change, config.max_request_bytes)
                      for p in config.pools}

    async def start(self) -> None:
        """Starts every worker at once; returns when each has passed its health check or been given up."""
        for p in self.pools.values():
            p.start()
        await asyncio.gather(*(p.wait_settled() for p in self.pools.values()))

    async def stop(self) -> None:
        try:
            await asyncio.gather(*(p.stop() for p in self.pools.values()))
        finally:
            self.kill_all()
            shutil.rmtree(self.sockets_dir, ignore_errors=True)

    def kill_all(self) -> None:
        for p in self.pools.values():
            p.kill_all()
