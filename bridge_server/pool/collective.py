"""Collectives: one call run on every rank of a pool at once, the results returned in rank order.

A torch.distributed collective blocks until every rank of the group has entered it, so the router
sends the call to all ranks together, and two collectives on one pool never overlap: each takes the
pool's collective lock, so every rank sees collectives in the same order.

Before any rank runs its share, every rank binds and checks it and says what all must agree on
(`_checked`): a share that one rank refuses, or tensors that differ between ranks, are refused with
nothing started. The rest of what can fail, fails inside the collective:

How a collective fails matters more than how it succeeds. When every rank fails the same way (a bad
argument, say), nothing is left behind and the first rank's error is returned. When some ranks fail
or die while others are still inside the collective, those others are stuck waiting for peers that
will never come: the caller gets an error naming the failed rank at once, and the pool restarts the
whole group, since a group cannot continue with a missing rank.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc

from bridge_server.pool.poolstate import Backend, Flight, PoolRouter, pool_error
from bridge_server.pool.router import Route, Router, read_route, routed_request
from bridge_server.wire.errors import STILL_RUNNING, BridgeError, detail_from_rpc_error, target_label
from bridge_server.wire.options import COLLECTIVE_CHECK, MD_COLLECTIVE
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, collective_calls, count_fields, parse_request
from bridge_server.wire.turns import Turns, read_in_turn
from vllm_bridge.v1 import bridge_pb2 as pb

CALL = "/vllm_bridge.v1.Bridge/Call"
# After a first rank fails, how long the others get to fail too before they count as stuck.
SETTLE_S = 0.5
# How long before the caller's deadline the router answers it, with ranks still running: its named
# error must reach the caller before gRPC's bare DEADLINE_EXCEEDED does.
MARGIN_S = 0.25
# How long after that the ranks still running get to end (each answers at the caller's deadline, or
# says it could not stop what it runs) before they count as stuck and the group restarts. A rank that
# was merely still running is not stuck: restarting then, a 30-byte `Collective` of `divide` with a
# 0.2 s deadline took a distributed pool down for 7-13 s, as often as a stranger sent it.
STUCK_GRACE_S = 2.0
# How long ranks may stay inside a collective after others have ended it. The ranks of one collective
# end within moments of each other (each waits for all); those still inside this long after another
# ended wait for peers that will not come, and the group restarts at once rather than at a deadline
# that a call with no deadline (`batch_job`) never reaches.
SKEW_S = 10.0


class _RankFailed(Exception):
    """One rank's failure, kept raw until every rank has settled and the cause can be told apart."""

    def __init__(self, rank: int, backend: Backend, flight: Flight, err: grpc.aio.AioRpcError | None) -> None:
        super().__init__(f"rank {rank} failed")
        self.rank, self.backend, self.flight, self.err = rank, backend, flight, err

    @property
    def died(self) -> bool:
        return bool(self.flight.failed) or self.err is None or (
            self.err.code() == grpc.StatusCode.UNAVAILABLE and detail_from_rpc_error(self.err) is None)

    def priority(self) -> int:
        """Which failure explains the others: a rank that died on its own, then a rank's Python
        error, then ranks stopped because the group is restarting."""
        if self.died:
            return 2 if _GROUP_STOP in self.backend.exit_reason else 0
        return 1

    def error(self) -> BridgeError:
        return _rank_error(self.rank, self.backend, self.flight, self.err)


_GROUP_STOP = "stopped to restart the group"


def _ranks_failed(errors: list[BaseException | None]) -> list[_RankFailed]:
    """The ranks' failures; any other exception (the router's own) is raised as it is."""
    for e in errors:
        if e is not None and not isinstance(e, _RankFailed):
            raise e
    return [e for e in errors if isinstance(e, _RankFailed)]


def _cause_first(e: _RankFailed) -> tuple[int, int]:
    return e.priority(), e.rank


def _named(error: BridgeError, label: str, said: str) -> BridgeError:
    """A rank's error as the collective's: its target, and what became of the rest."""
    error.message = f"collective {label}: {error.message}{said}"
    error.target = error.target or label
    return error


def _rank_error(rank: int, backend: Backend, flight: Flight, err: grpc.aio.AioRpcError | None) -> BridgeError:
    """The failure of one rank, named: the worker's own error (its detail kept), or its death."""
    if flight.failed or err is None or (err.code() == grpc.StatusCode.UNAVAILABLE
                                        and detail_from_rpc_error(err) is None):
        why = f" ({backend.exit_reason})" if backend.exit_reason else ""
        return pool_error(grpc.StatusCode.UNAVAILABLE, f"rank {rank} (worker {backend.id}) died during the "
                          f"collective: {flight.failed or 'worker crashed'}{why}", "rank failed", "worker")
    detail = detail_from_rpc_error(err)
    said = err.details()
    if detail is not None and detail.reason == "wrong worker":
        # (the worker's hint is about a Call's routing: a Collective's calls go to their ranks instead)
        said = (f"ref {detail.parameter} is not this rank's: a Collective runs the call for rank {rank} on rank "
                f"{rank}'s worker, so the refs it carries must have been made there (a ref from another rank's "
                f"call, or from another pool, is not)")
    out = BridgeError(err.code(), detail.category if detail else "grpc_error",
                      f"rank {rank} (worker {backend.id}): {said}", reason="rank failed")
    if detail is not None:
        out.python_type, out.traceback, out.target, out.parameter = (detail.python_type, detail.traceback,
                                                                     detail.target, detail.parameter)
    return out


async def _on_rank(rank: int, backend: Backend, payload: bytes, metadata: list[tuple[str, Any]],
                   timeout: float | None) -> bytes:
    flight = Flight()
    backend.flights.add(flight)      # a worker's death fails this at once (supervisor's exit watcher)
    backend.in_flight += 1
    try:
        upstream = backend.stubs[CALL](payload, metadata=metadata, timeout=timeout)
        flight.call = upstream
        try:
            reply: bytes = await upstream
            return reply
        except asyncio.CancelledError:
            if flight.failed:
                raise _RankFailed(rank, backend, flight, None) from None
            raise
        except grpc.aio.AioRpcError as err:
            raise _RankFailed(rank, backend, flight, err) from None
    finally:
        backend.flights.discard(flight)
        backend.in_flight -= 1


MAX_RANKS = 4096     # per_rank calls in one Collective at most (a pool has as many ranks as workers)


def read_collective(request: bytes, limit: int | None) -> pb.CollectiveRequestView:
    """A Collective's calls, counted before any parse: 26 million empty per_rank entries took the
    pool server's loop 1.4 s and 1 GB to parse."""
    if len(request) >= LARGE_REQUEST_BYTES and count_fields(request, MAX_RANKS + 1) > MAX_RANKS + 1:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"Collective: more than {MAX_RANKS:,} calls in one request", parameter="per_rank",
                          reason="too many ranks")
    return parse_request(pb.CollectiveRequestView, request, "Collective", limit)


def _payloads(request: pb.CollectiveRequestView, pool: PoolRouter) -> tuple[list[bytes], str, bool]:
    """The per-rank CallRequest payloads, as bytes (only the target, for messages, is decoded), and
    whether each rank has its own (`per_rank`)."""
    ranks = pool.config.workers
    payloads = collective_calls(request)
    if request.per_rank and len(payloads) != ranks:
        raise BridgeError.validation(f"Collective: per_rank has {len(payloads)} calls, but pool {pool.name!r} has "
                                     f"{ranks} rank{'s' if ranks != 1 else ''}", parameter="per_rank")
    if not request.per_rank:
        payloads *= ranks
    calls = [routed_request(p, f"Collective: the call for rank {r}") for r, p in enumerate(payloads)]
    targets = {(c.target.kind, c.target.name) for c in calls}   # receivers may differ: each rank's own ref
    if len(targets) > 1:
        # Ranks inside different collectives wait for each other forever: refused before any starts.
        names = ", ".join(f"rank {r}: {target_label(c.target)} ({pb.Target.Kind.Name(c.target.kind)})"
                          for r, c in enumerate(calls))
        raise BridgeError.validation(f"Collective: every rank must run the same target, of the same kind; got "
                                     f"{names}", parameter="per_rank")
    return payloads, target_label(calls[0].target), bool(request.per_rank)


async def _checked(backends: list[Backend], payloads: list[bytes], forwarded: list[tuple[str, Any]], route: Route,
                   label: str, per_rank: bool) -> None:
    """Every rank binds and checks its share, and says what all must agree on (its tensors' dtypes
    and shapes), before any rank runs its own. A rank refused after the others had entered the
    collective left them inside it for good, and ranks whose tensors disagree abort the process group
    (gloo kills rank 0 with SIGABRT): either way the group restarted and every client's refs on it
    were lost, as often as a stranger sent 30 bytes. Refused here, nothing has started."""
    metadata = [*forwarded, (MD_COLLECTIVE, COLLECTIVE_CHECK)]
    left = _remaining(route)
    tasks = [asyncio.create_task(_on_rank(r, b, payloads[r], metadata, left)) for r, b in enumerate(backends)]
    try:
        await asyncio.wait(tasks)
    finally:
        for t in tasks:
            t.cancel()
    failed = _ranks_failed([t.exception() for t in tasks])
    if failed:
        first = min(failed, key=_cause_first)
        error = _named(first.error(), label, " (every rank's share is checked first: none ran)")
        if per_rank and not first.died:
            error.parameter = f"per_rank[{first.rank}]" + (f".{error.parameter}" if error.parameter else "")
        raise error
    said = [pb.CallReply.FromString(t.result()).value.str for t in tasks]
    for rank, text in enumerate(said):
        if text != said[0]:
            raise BridgeError.validation(
                f"collective {label}: rank {rank}'s share disagrees with rank 0's: {text or 'no tensors'} against "
                f"{said[0] or 'no tensors'} (every rank gives a collective tensors of the same dtypes and shapes, and "
                f"names the same source or destination rank; ranks that do not abort the process group or wait "
                f"for each other for ever)",
                target=label, parameter=f"per_rank[{rank}]" if per_rank else "per_rank")


def _remaining(route: Route) -> float | None:
    return None if route.deadline is None else max(0.0, route.deadline - time.monotonic())


async def run_collective(router: Router, request: bytes, context: grpc.aio.ServicerContext,
                         forwarded: list[tuple[str, Any]], limit: int | None = None,
                         identity: str = "", turns: Turns | None = None) -> tuple[str, bytes]:
    """Returns (pool name, CollectiveReply bytes); raises BridgeError. `forwarded` is the caller's
    metadata as the ranks get it (its identity included)."""
    route = read_route(context.invocation_metadata(), context.time_remaining(), identity=identity)
    pool = router.pool(route.opts.pool)
    payloads, label, per_rank = await read_in_turn(
        turns or Turns(), route.client, len(request),
        lambda: _payloads(read_collective(request, limit), pool), "Collective", _remaining(route))
    left = _remaining(route)
    try:
        # answered before the caller's deadline, so that this error reaches it, not gRPC's bare one
        await asyncio.wait_for(pool.collective_lock.acquire(), None if left is None else max(0.0, left - MARGIN_S))
    except TimeoutError:
        why = f"waiting for pool {pool.name!r}'s previous collective" if pool.collective_lock.locked() else \
            f"before it could start ({(left or 0.0) * 1000:.0f} ms were left)"
        raise BridgeError.timeout(f"collective {label}: deadline exceeded {why}", target=label) from None
    watched: list[asyncio.Task[None]] = []
    try:
        backends = pool.group()
        await _checked(backends, payloads, forwarded, route, label, per_rank)
        # The ranks' own deadline is later than the caller's by the grace: what ends them first is the
        # worker's answer (which says whether its work goes on), not gRPC's, which says nothing.
        left = _remaining(route)
        upstream_timeout = left + STUCK_GRACE_S if route.explicit_deadline and left is not None else None
        metadata = [*forwarded, (MD_COLLECTIVE, "1")]
        tasks = [asyncio.create_task(_on_rank(r, b, payloads[r], metadata, upstream_timeout))
                 for r, b in enumerate(backends)]
        try:
            return pool.name, await _gather(tasks, route, label, pool, watched)
        finally:
            for t in tasks:
                if not watched:
                    t.cancel()
    finally:
        if watched:         # the lock goes with the ranks still running: no collective overtakes them
            watched[0].add_done_callback(lambda _: pool.collective_lock.release())
        else:
            pool.collective_lock.release()


async def _gather(tasks: list[asyncio.Task[bytes]], route: Route, label: str, pool: PoolRouter,
                  watched: list[asyncio.Task[None]]) -> bytes:
    # The router's own deadline comes first (the ranks' calls carry the caller's whole deadline): it
    # decides whether ranks are stuck, and its named error must reach the caller before gRPC's own.
    left = _remaining(route)
    loop = asyncio.get_running_loop()
    until = None if left is None else loop.time() + max(0.0, left - MARGIN_S)
    done: set[asyncio.Task[bytes]] = set()
    pending: set[asyncio.Task[bytes]] = set(tasks)
    first_end: float | None = None
    while pending:
        now = loop.time()
        waits = [t - now for t in (until, None if first_end is None else first_end + SKEW_S) if t is not None]
        more, pending = await asyncio.wait(pending, timeout=max(0.0, min(waits)) if waits else None,
                                           return_when=asyncio.FIRST_COMPLETED)
        done |= more
        if not more or any(t.exception() is not None for t in more):
            break           # the deadline, ranks left inside SKEW_S after others ended, or a failure
        first_end = first_end if first_end is not None else loop.time()
    failed = [t for t in done if t.exception() is not None]
    if failed and pending:        # the others may only be waiting for the failed rank: give them a moment
        more, pending = await asyncio.wait(pending, timeout=SETTLE_S)
        done |= more
        failed = [t for t in done if t.exception() is not None]
    if failed:
        ranked = _ranks_failed([t.exception() for t in failed])
        dead = [e.backend.died.wait() for e in ranked if e.died]
        if dead:    # let the supervisor record why they died before choosing the cause
            await asyncio.wait([asyncio.ensure_future(d) for d in dead], timeout=SETTLE_S)
        first = min(ranked, key=_cause_first)
        error = first.error()       # as the rank failed, before the restart says anything of it
        restarting = bool(pending) or any(e.priority() == 2 for e in ranked) or any(e.died for e in ranked)
        if pending:
            stuck = sorted(tasks.index(t) for t in pending)
            pool.restart_group(f"collective {label} failed on rank {first.rank} while rank(s) "
                               f"{', '.join(map(str, stuck))} were still in it")
        raise _named(error, label, "; the group is restarting" if restarting else "")
    if pending and first_end is not None and (until is None or loop.time() < until):
        # The ranks that ended left the others inside: those wait for peers that will not come (their
        # shares did not match: process groups of one rank on one side, of two on the other). With
        # no deadline (`batch_job`) they held the pool's lock, every other client's collectives
        # behind it, for as long as their caller stayed, health SERVING.
        stuck = sorted(tasks.index(t) for t in pending)
        ended = sorted(tasks.index(t) for t in done)
        pool.restart_group(f"collective {label}: rank(s) {', '.join(map(str, stuck))} still in it {SKEW_S:g} s after "
                           f"rank(s) {', '.join(map(str, ended))} ended")
        raise BridgeError(grpc.StatusCode.ABORTED, "pool",
                          f"collective {label}: rank(s) {', '.join(map(str, stuck))} were still in it {SKEW_S:g} s "
                          f"after rank(s) {', '.join(map(str, ended))} had ended, waiting for peers that will not "
                          f"come (every rank's share must meet the others'); the group is restarting",
                          target=label, reason="ranks stuck")
    if pending:
        ranks = ", ".join(str(tasks.index(t)) for t in sorted(pending, key=tasks.index))
        watched.append(asyncio.get_running_loop().create_task(_restart_if_stuck(tasks, pending, label, pool)))
        raise BridgeError.timeout(f"collective {label}: deadline exceeded with rank(s) {ranks} still running (the "
                                  f"group restarts if they are stuck: still running {STUCK_GRACE_S:g} s later)",
                                  target=label)
    return pb.CollectiveReplyView(results=[t.result() for t in tasks]).SerializeToString()


async def _restart_if_stuck(tasks: list[asyncio.Task[bytes]], pending: set[asyncio.Task[bytes]], label: str,
                            pool: PoolRouter) -> None:
    """The ranks still running when the caller was answered. Those inside a collective whose peers
    never come cannot be pre-empted (they wait in C code), and every later collective would queue
    behind them: if one has not ended STUCK_GRACE_S later, or ended saying that what it ran goes on
    (a worker gives up a call at its deadline, but not the thread that runs it), the group starts
    again. Ranks that end by then were only slow, and the group goes on."""
    done, still = await asyncio.wait(pending, timeout=STUCK_GRACE_S)
    for t in still:
        t.cancel()
    stuck = sorted(tasks.index(t) for t in still)
    for t in done:
        exc = t.exception() if not t.cancelled() else None
        if not isinstance(exc, _RankFailed):
            continue
        detail = detail_from_rpc_error(exc.err) if exc.err is not None else None
        unknown = exc.err is not None and detail is None and exc.err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        if exc.died or unknown or (detail is not None and detail.reason == STILL_RUNNING):
            stuck.append(tasks.index(t))
    if stuck:
        pool.restart_group(f"collective {label} exceeded its deadline with rank(s) "
                           f"{', '.join(map(str, sorted(stuck)))} still in it")
