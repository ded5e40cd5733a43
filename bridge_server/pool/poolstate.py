"""One pool's live state: its workers' slots, its queue of waiting calls, its session pins.

The router (`router.py`) decides *where* a call may run and hands that decision over as a `Plan`;
this module reserves the slot, or queues the call until one frees up, counting the wait against
the call's deadline. Everything here runs on the server's one event loop, so it takes no locks.

The queue is fair between clients (`router.client_of`: an identity, or where the server has no
authentication a connection, and each Multiplex stream on it): a freed slot goes to the waiting
client served least recently, each client's calls in their order of arrival, and no client may take
the last quarter of the queue (`client_share`), nor may the clients of one host together (as the
backlog and the workers' turns count hosts: a stranger opens as many connections as it likes, but
from the hosts it has). A client that queues a thousand calls at once then neither fills the queue
for everyone else nor puts them behind all of its own calls: another client's call waits for the
next free slot; and a second stream of the same stranger finds only what its host has left.

Slots are kept for others too: one host (an identity, where the server has one) holds at most
`host_slot_share` of a pool's slots at once (15/16: 60 of 64; the part kept is rounded down, so a
pool of fewer than 16 slots keeps none), and its further calls wait, so that others' calls still
run. One connection's 64 streams of long generations, each read as it came, had held every slot:
every other client's call, a `divide` too, waited 60 s and failed, with health SERVING.

A slot may be held by a stream whose caller reads nothing: the worker has a whole window of items
out that nobody credits back, or, for a short stream the worker is done with, the router's write to
the caller waits. That is bounded by `reader_stall_s` (60 s) everywhere; while calls
wait in the queue, the pool ends such streams after `contended_stall_s` (5 s) instead, so a caller
that stops reading a pool's worth of streams delays others by seconds, not minutes.

Session pins are remembered up to SESSION_CAP, and the least recently used go first; but not
across clients at will: a host that holds more than half of them evicts its own (and, within it, a
connection that holds more than half of its host's, its own). A stranger's 100,000 calls under new
session names had evicted every other client's pins, moving a strict session off the worker that
held its state.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from bridge_server.pool.config import PoolConfig
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.options import connection_of
from bridge_server.wire.protocol import host_of
from bridge_server.wire.stall import Waiting, contended_stall

READY, DRAINING, DEAD = "ready", "draining", "dead"
# A live worker that takes no new calls for now: it says it cannot serve (health NOT_SERVING), or its
# lane is being reopened. Calls bound to it (its refs, strict sessions) still reach it.
UNHEALTHY, RECONNECTING = "unhealthy", "reconnecting"
SESSION_CAP = 100_000          # pinned sessions remembered per pool (least recently used go first)
PIN_HOST_SHARE = 0.5           # of SESSION_CAP: past it, a host's new pins evict its own (the module's doc)
_Pinner = tuple[str, str]       # ("host", a host) or ("connection", a connection): who pinned a session
# Our own deadline error must reach the caller before its deadline does. The server's deadline starts
# when the call's headers are read, so it trails the caller's by the request's transit, and the error
# still has to travel back: 5 ms was too little on a loaded 2-vCPU machine (the caller's own bare
# DEADLINE_EXCEEDED won, once in a full test run), so 20 ms, a small share of any deadline worth setting.
DEADLINE_MARGIN_S = 0.020
STALLED_AFTER_S = 1.0          # a stream that has waited on its caller this long counts as stalled


def client_share(queue_size: int) -> int:
    """The most calls one client may have waiting in a queue of `queue_size`: all but the last quarter,
    kept for other clients."""
    return queue_size - queue_size // 4


def pool_error(code: grpc.StatusCode, message: str, reason: str, category: str = "pool") -> BridgeError:
    return BridgeError(code, category, message, reason=reason)


@dataclass(eq=False)
class Flight:
    """One forwarded call, tracked so that a worker's death fails it at once instead of hanging, and
    so that the pool can end a Stream whose caller stopped reading while calls queue."""

    call: Any = None              # the upstream grpc.aio call, once made
    failed: str = ""              # set by `Backend.fail_flights`: the reason the call must report
    waiting: float = 0.0          # since when a Stream's write has waited on its caller (0: none waits)
    on_stalled: Callable[[BridgeError], None] | None = None   # how its forwarder ends it for that
    writer: Waiting | None = None   # what notes its writes' waits instead, when others share them (Multiplex)
    lane_call: Any = None         # the lane call it runs as (whose full window is a stall of the same call)

    def fail(self, reason: str) -> None:
        self.failed = reason
        if self.call is not None:
            self.call.cancel()

    def stall(self, err: BridgeError) -> None:
        """Ends the call for its stalled caller (once)."""
        hook, self.on_stalled = self.on_stalled, None
        if hook is not None:
            hook(err)


@dataclass(eq=False)
class Backend:
    """A live worker as the router sees it: where it is, how busy, what it holds."""

    id: str
    pool: str
    address: str
    max_concurrent: int
    index: int = 0                # its slot in the pool (= its rank in a distributed pool)
    channel: Any = None           # grpc.aio.Channel; multicallables are made once, by forward.py
    stubs: dict[str, Any] = field(default_factory=dict)
    lane: Any = None              # lane.Lane: how Call and Stream reach the worker
    state: str = READY
    in_flight: int = 0
    calls: int = 0
    sessions: int = 0
    refs: int = -1                # as last reported by the worker (trailing metadata, lane replies)
    flights: set[Flight] = field(default_factory=set)
    died: asyncio.Event = field(default_factory=asyncio.Event)
    exit_reason: str = ""

    def has_slot(self) -> bool:
        return self.in_flight < self.max_concurrent

    def fail_flights(self, reason: str) -> int:
        flights, self.flights = self.flights, set()
        for f in flights:
            f.fail(reason)
        return len(flights)

    def stalled(self, before: float) -> list[Callable[[BridgeError], None]]:
        """How to end each of this worker's streams that has waited on its caller since before
        `before` (monotonic): a whole window of items the router has not credited (its lane), or a
        write to its caller that gRPC has held back (its flight: a Stream's own, or its Multiplex
        stream's). The second holds its slot as long with nothing left to send: a short stream whose
        items the caller leaves unread, its worker done with it, never fills a window, and a
        Multiplex call whose client credits it without reading never does."""
        ends: list[Callable[[BridgeError], None]] = []
        windowed = set()
        if self.lane is not None:
            for lc in self.lane.stalled(before):
                ends.append(lc.stall)
                windowed.add(id(lc))
        for f in self.flights:
            waiting = f.waiting if f.writer is None else f.writer.waiting
            if 0.0 < waiting <= before and f.on_stalled is not None and id(f.lane_call) not in windowed:
                ends.append(f.stall)
        return ends


@dataclass(eq=False)
class Waiter:
    required: Backend | None          # must run there (a ref's worker, a strict session's worker)
    preferred: Backend | None         # rather there, else anywhere (hint)
    future: asyncio.Future[Backend]
    client: str = ""                  # whose call it is (see the module docstring)
    since: float = field(default_factory=time.monotonic)


class Plan:
    """Where a call may run: on `required`, else on `preferred` if free, else anywhere in `pool`."""

    __slots__ = ("pool", "required", "preferred", "fail_fast", "what", "pin")

    def __init__(self, pool: PoolRouter, required: Backend | None, preferred: Backend | None, fail_fast: bool,
                 what: str, pin: str | None) -> None:
        self.pool = pool
        self.required = required
        self.preferred = preferred
        self.fail_fast = fail_fast
        self.what = what              # what binds the call to `required`, for "worker busy"
        self.pin = pin                # a session to pin to wherever the call runs


class PoolRouter:
    """One pool's workers, queue and session pins."""

    def __init__(self, config: PoolConfig) -> None:
        self.config = config
        self.name = config.name
        self.backends: list[Backend] = []
        self.queue: deque[Waiter] = deque()
        self.queued: Counter[str] = Counter()     # waiters per client
        self.queued_by_host: Counter[str] = Counter()   # the same per host (wire.protocol.host_of)
        self.served: dict[str, int] = {}          # client -> when it was last given a slot from the queue
        self.holding: Counter[str] = Counter()    # slots held, by host (an identity: by identity)
        self._grants = itertools.count()
        self.sessions: OrderedDict[str, Backend] = OrderedDict()
        # Who pinned each session (host, connection), and each one's pins, least recently used first.
        self._pinner: dict[str, tuple[_Pinner, _Pinner]] = {}
        self._pins_of: dict[_Pinner, OrderedDict[str, None]] = {}
        self.unavailable = ""        # set by the supervisor when no worker will come (degraded, stopping)
        # Distributed pools: collectives run one at a time on all ranks, in the order they arrive,
        # or the group deadlocks; and a broken collective restarts the group (set by the supervisor).
        self.collective_lock = asyncio.Lock()
        self.restart_group: Callable[[str], None] = lambda reason: None
        self.observe_wait: Callable[[float], None] = lambda seconds: None   # metrics hook
        self._stall_sweeper: asyncio.Task[None] | None = None   # runs while calls wait (`_sweep_stalls`)

    # ------------------------------------------------------------------------------- membership
    def add(self, backend: Backend) -> None:
        self.backends.append(backend)
        self.dispatch()

    def remove(self, backend: Backend, reason: str, message: str) -> None:
        """The worker is gone: fail its calls, and the waiters that could only run on it."""
        backend.state = DEAD
        backend.exit_reason = message
        if backend in self.backends:
            self.backends.remove(backend)
        backend.fail_flights(reason)
        backend.died.set()
        for w in [w for w in self.queue if w.required is backend]:
            self._unqueue(w)
            if not w.future.done():
                w.future.set_exception(self._lost(f"the worker {backend.id} it was waiting for died", backend))
        self.check_available()
        self.dispatch()

    def set_unavailable(self, why: str) -> None:
        self.unavailable = why
        self.check_available()

    def check_available(self) -> None:
        """With no worker left and none coming, waiting is pointless: fail the queue."""
        if self.unavailable and not any(b.state == READY for b in self.backends):
            while self.queue:
                w = self.queue[0]
                self._unqueue(w)
                if not w.future.done():
                    w.future.set_exception(self.unavailable_error())

    def unavailable_error(self) -> BridgeError:
        return pool_error(grpc.StatusCode.UNAVAILABLE, f"pool {self.name!r} has no live worker: {self.unavailable}",
                          "no live worker")

    def _lost(self, what: str, backend: Backend) -> BridgeError:
        why = f" ({backend.exit_reason})" if backend.exit_reason else ""
        return pool_error(grpc.StatusCode.UNAVAILABLE, f"worker lost: {what}{why}", "worker lost", "worker")

    def rank_backend(self, rank: int) -> Backend:
        """`x-bridge-rank: N` asks for the worker in slot N (in a distributed pool, rank N)."""
        if rank >= self.config.workers:
            workers = f"{self.config.workers} worker{'s' if self.config.workers != 1 else ''}"
            raise BridgeError.validation(f"pool {self.name!r} has {workers}: no rank {rank}",
                                         parameter="x-bridge-rank")
        live = [b for b in self.backends if b.index == rank]
        if not live:
            raise pool_error(grpc.StatusCode.UNAVAILABLE, f"pool {self.name!r} has no live worker for rank {rank} "
                             f"now", "no live worker")
        return min(live, key=lambda b: b.state != READY)

    def group(self) -> list[Backend]:
        """Every rank's live worker, in rank order; UNAVAILABLE naming the missing ranks otherwise."""
        by_rank = {b.index: b for b in self.backends if b.state == READY}
        missing = [r for r in range(self.config.workers) if r not in by_rank]
        if missing:
            why = f" ({self.unavailable})" if self.unavailable else ""
            raise pool_error(grpc.StatusCode.UNAVAILABLE, f"pool {self.name!r} cannot run a collective now: rank(s) "
                             f"{', '.join(map(str, missing))} not ready (the group is starting or restarting){why}",
                             "group not ready")
        return [by_rank[r] for r in range(self.config.workers)]

    # ------------------------------------------------------------------------------- sessions
    def pinned(self, session: str) -> Backend | None:
        b = self.sessions.get(session)
        if b is not None:
            self.sessions.move_to_end(session)
            for key in self._pinner[session]:
                self._pins_of[key].move_to_end(session)
        return b

    def pin(self, session: str, backend: Backend, client: str = "") -> None:
        """Pins `session` to `backend` for `client` (`router.client_of`; "" for the server's own)."""
        old = self.sessions.get(session)
        if old is backend:
            return
        self.unpin(session)
        self.sessions[session] = backend
        backend.sessions += 1
        keys = self._pinner[session] = (("host", host_of(client)), ("connection", connection_of(client)))
        for key in keys:
            self._pins_of.setdefault(key, OrderedDict())[session] = None
        while len(self.sessions) > SESSION_CAP:
            self.unpin(self._pin_to_evict(*keys))

    def _pin_to_evict(self, host: _Pinner, connection: _Pinner) -> str:
        """The least recently used pin; but the adder's own host's (or connection's) when it holds
        more than its share (the module's doc), so that no client evicts the others' pins at will."""
        of_host = self._pins_of[host]
        if len(of_host) > SESSION_CAP * PIN_HOST_SHARE:
            of_connection = self._pins_of[connection]
            return next(iter(of_connection if len(of_connection) > len(of_host) // 2 else of_host))
        return next(iter(self.sessions))

    def unpin_for(self, session: str, client: str) -> bool:
        """`client`'s release of `session` unpins it where the client's host pinned it (or the server
        did); says whether it did. Without authentication every client names sessions alike, and a
        stranger's release of another host's session dropped its pin: the owner's next `strict_queue`
        call ran on another worker, away from its state. (With an identity a session is its own.)"""
        keys = self._pinner.get(session)
        if keys is None:
            return False
        pinner = keys[0][1]
        if pinner and pinner != host_of(client):
            return False
        self.unpin(session)
        return True

    def unpin(self, session: str) -> None:
        old = self.sessions.pop(session, None)
        if old is None:
            return
        old.sessions -= 1
        for key in self._pinner.pop(session):
            pins = self._pins_of[key]
            del pins[session]
            if not pins:
                del self._pins_of[key]

    # ------------------------------------------------------------------------------- capacity
    def _free_backend(self, preferred: Backend | None) -> Backend | None:
        if preferred is not None and preferred.state == READY and preferred.has_slot():
            return preferred
        # The least busy worker; among equals the one with the fewest pinned sessions, so that new
        # sessions spread over the pool instead of piling onto the first worker.
        best: Backend | None = None
        for b in self.backends:
            if b.state == READY and b.has_slot() and (
                    best is None or (b.in_flight, b.sessions) < (best.in_flight, best.sessions)):
                best = b
        return best

    def _at_share(self, client: str) -> bool:
        """Whether `client`'s host holds all the slots it may (see the module docstring)."""
        if not client:
            return False
        slots = sum(b.max_concurrent for b in self.backends if b.state == READY)
        kept = int(slots * (1.0 - self.config.host_slot_share))
        return self.holding[host_of(client)] >= max(1, slots - kept)

    def _granted(self, client: str) -> None:
        if client:
            self.holding[host_of(client)] += 1

    def _pick(self, w: Waiter) -> Backend | None:
        if self._at_share(w.client):
            return None
        if w.required is not None:
            return w.required if w.required.state != DEAD and w.required.has_slot() else None
        return self._free_backend(w.preferred)

    def dispatch(self) -> None:
        """Hands free slots to waiters: first to the client served least recently, and within a
        client in arrival order (a waiter that cannot use a free slot is skipped)."""
        while self.queue:
            best: tuple[int, Waiter, Backend] | None = None
            looked: set[str] = set()
            for w in self.queue:
                if w.client in looked or w.future.done():
                    continue
                b = self._pick(w)
                if b is None:
                    continue
                looked.add(w.client)
                rank = self.served.get(w.client, -1)
                if best is None or rank < best[0]:
                    best = (rank, w, b)
                    if rank < 0:       # a client not served from the queue yet: the first such goes first
                        break
            if best is None:
                return
            _, w, b = best
            self._unqueue(w)
            if len(self.served) > 4 * self.config.queue_size + 1024:   # clients long gone
                self.served = {c: self.served[c] for c in self.queued if c in self.served}
            self.served[w.client] = next(self._grants)
            b.in_flight += 1
            self._granted(w.client)
            self.observe_wait(time.monotonic() - w.since)
            w.future.set_result(b)
            if not any(x.has_slot() for x in self.backends):
                return

    def _unqueue(self, w: Waiter) -> None:
        self.queue.remove(w)
        for counts, key in ((self.queued, w.client), (self.queued_by_host, host_of(w.client))):
            left = counts[key] - 1
            if left > 0:
                counts[key] = left
            else:
                del counts[key]

    def release(self, backend: Backend, client: str = "") -> None:
        """The slot `client`'s call held on `backend` is free again."""
        backend.in_flight -= 1
        backend.calls += 1
        if client:
            host = host_of(client)
            left = self.holding[host] - 1
            if left > 0:
                self.holding[host] = left
            else:
                del self.holding[host]
        if self.queue:
            self.dispatch()

    def take(self, plan: Plan, client: str = "") -> Backend | None:
        """A free slot for `client`'s call now (reserved), or None: then it must wait in the queue."""
        required = plan.required
        if required is not None:
            if required.has_slot() and not self._at_share(client):
                required.in_flight += 1
                self._granted(client)
                return required
            if plan.fail_fast:
                raise pool_error(grpc.StatusCode.UNAVAILABLE,
                                 f"worker busy: {plan.what} runs on worker {required.id}, which has all its "
                                 f"{required.max_concurrent} slots taken (affinity strict_fail_fast)", "worker busy")
            return None
        if self._at_share(client):
            return None
        b = self._free_backend(plan.preferred)
        if b is not None:
            b.in_flight += 1
            self._granted(client)
            return b
        if self.unavailable and not any(x.state == READY for x in self.backends):
            raise self.unavailable_error()
        return None

    def _full(self, whose: str, held: str, share: int, kept: str, reason: str) -> BridgeError:
        return pool_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"queue full for {whose}: {held} wait in pool {self.name!r}'s queue, the most it may have "
                          f"now ({share} of queue_size {self.config.queue_size}: {kept}), and every slot is busy",
                          reason)

    async def wait(self, plan: Plan, deadline: float | None, client: str = "") -> Backend:
        """Queues `client`'s call until `take` would succeed; `deadline` (monotonic) bounds the wait."""
        return await self._wait(deadline, plan.required, plan.preferred, client)

    async def _wait(self, deadline: float | None, required: Backend | None, preferred: Backend | None,
                    client: str) -> Backend:
        size = self.config.queue_size
        if len(self.queue) >= size:
            raise pool_error(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"queue full: pool {self.name!r} has {len(self.queue)} calls waiting "
                             f"(queue_size {size}) and every slot busy", "queue full")
        share = client_share(size)
        host = host_of(client)
        if host != client:
            if self.queued_by_host[host] >= share:
                raise self._full("this host", f"{self.queued_by_host[host]} calls from {host}", share,
                                 "the last quarter is kept for other hosts", "host queue full")
            # within its host, a client takes at most three quarters of what the host's others left
            share = client_share(share - (self.queued_by_host[host] - self.queued[client]))
        if self.queued[client] >= share:
            raise self._full("this client", f"{self.queued[client]} of its calls", share,
                             "the last quarter of the queue, and of what its host's other connections left, is "
                             "kept for others", "client queue full")
        loop = asyncio.get_running_loop()
        waiter = Waiter(required, preferred, loop.create_future(), client)
        timer = None
        if deadline is not None:
            delay = max(0.0, deadline - time.monotonic() - DEADLINE_MARGIN_S)
            timer = loop.call_later(delay, self._expire, waiter)
        self.queue.append(waiter)
        self.queued[client] += 1
        self.queued_by_host[host] += 1
        if any(b.has_slot() for b in self.backends):
            # Slots freed since the caller found none (a Multiplex start queues from a task of its own):
            # every release dispatched to an empty queue then, so nothing else would wake this waiter.
            self.dispatch()
        if self.queue and self._stall_sweeper is None and self.config.contended_stall_s > 0:
            self._stall_sweeper = loop.create_task(self._sweep_stalls())
        try:
            return await waiter.future
        except asyncio.CancelledError:
            f = waiter.future
            if f.done() and not f.cancelled() and f.exception() is None:
                self.release(f.result(), client)      # given a slot just as the caller went away
            raise
        finally:
            if timer is not None:
                timer.cancel()
            if waiter in self.queue:
                self._unqueue(waiter)

    async def _sweep_stalls(self) -> None:
        """While calls wait, ends the streams that have waited on their caller for contended_stall_s
        on a worker a waiting call could use (within a quarter of the bound late)."""
        bound = self.config.contended_stall_s
        try:
            while self.queue:
                await asyncio.sleep(min(1.0, bound / 4))
                self.end_stalled(time.monotonic() - bound)
        finally:
            self._stall_sweeper = None

    def stalled_streams(self) -> int:
        """How many of the pool's streams have waited on their caller for STALLED_AFTER_S or more (what
        `end_stalled` ends while calls wait): for the pool's status and metrics."""
        before = time.monotonic() - STALLED_AFTER_S
        return sum(len(b.stalled(before)) for b in self.backends)

    def end_stalled(self, before: float) -> int:
        """Ends the streams on workers the queue waits for that have waited on their caller since
        before `before` (monotonic, `Backend.stalled`); returns how many."""
        if any(w.required is None for w in self.queue):
            wanted: list[Backend] = list(self.backends)
        else:
            wanted = list({id(w.required): w.required for w in self.queue if w.required is not None}.values())
        ended = 0
        for b in wanted:
            for end in b.stalled(before):
                end(contended_stall(self.name, self.config.contended_stall_s))
                ended += 1
        return ended

    def _expire(self, waiter: Waiter) -> None:
        if waiter.future.done():
            return
        if waiter in self.queue:
            self._unqueue(waiter)
        waited = time.monotonic() - waiter.since
        err = BridgeError.timeout(f"deadline exceeded after {waited:.3f} s waiting in pool {self.name!r}'s queue "
                                  f"for a free worker slot")
        waiter.future.set_exception(err)
