"""Routing decisions: which worker runs a call, when, or why not.

Everything here reads only what the gRPC metadata says (pool, session, affinity, the refs a call uses)
and the live state of the workers; the payload is never decoded. The rules:

- a call that uses refs runs on the worker that holds them (its id is the ref ids' prefix), whatever
  the affinity says; `strict_fail_fast` still fails at once when that worker is busy. The refs are
  those in `x-bridge-refs` and those the request itself carries (its receiver, and refs among its
  arguments, read without decoding a value: `payload_refs`);
- a session is pinned to the worker that first served it; per call, `hint` prefers that worker but
  runs anywhere when it has no free slot, `strict_queue` waits for it, `strict_fail_fast` fails with
  "worker busy"; if that worker died, `hint` re-pins the session and the strict modes fail with
  "worker lost" (until the session is released);
- `x-bridge-rank: N` (a ref-free call) runs on the worker in slot N of the pool;
- each worker runs at most `max_concurrent` calls; the rest wait in a bounded per-pool queue, fair
  between clients, and waiting counts against the call's deadline (that part lives in `poolstate.py`).

The router runs on one asyncio loop and is never touched from another thread, so it takes no locks.
Forwarding the bytes is `forward.py`'s job; starting and stopping processes is the supervisor's.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass

import grpc
from google.protobuf.message import DecodeError

from bridge_server.pool.config import PoolConfig
from bridge_server.pool.poolstate import (
    DEAD,
    DEADLINE_MARGIN_S,
    READY,
    Backend,
    Plan,
    PoolRouter,
    pool_error,
)
from bridge_server.wire.errors import BridgeError, quote
from bridge_server.wire.options import (
    MD_RANK,
    MD_REFS,
    PROFILES,
    RuntimeOptions,
    explicit_timeout,
    multiplex_client,
    parse_metadata,
)
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, parse_request, read_large_call
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["Route", "Router", "read_route", "routed_request", "session_key", "time_left"]


@dataclass
class Route:
    """What the metadata (and the request's own refs) say about one call, read once."""

    opts: RuntimeOptions
    session: str | None               # None when the caller sent no session: no pinning
    deadline: float | None            # absolute monotonic; counts the queue wait
    explicit_deadline: bool           # from the caller (gRPC deadline or timeout-ms): forwarded upstream
    refs: tuple[str, ...] = ()        # every ref the call uses: x-bridge-refs and the request's own
    client: str = ""                  # whose call it is, for the queue's fairness (`client_of`)


_streams = itertools.count(1)


def client_of(identity: str, context: grpc.aio.ServicerContext, multiplex: bool = False) -> str:
    """Who a call is for, as the queue tells clients apart: its identity where the server
    authenticates; else its connection (a peer address), and for calls over Multiplex, the
    Multiplex stream (the channels of one process share a connection, and a client that starts many
    calls at once starts them over one stream)."""
    if identity:
        return identity
    peer = context.peer() or ""
    return multiplex_client(peer, next(_streams)) if multiplex else peer


def session_key(identity: str, session: str) -> str:
    """How the router knows a session: sessions belong to their client, so two clients' sessions of
    the same name are two sessions (a name holds no "/"; a session id may)."""
    return f"{identity}/{session}" if identity else session


def routed_request(raw: bytes, rpc: str, limit: int | None = None, router: Router | None = None) -> pb.CallRequest:
    """A CallRequest as the router reads it: whole when small, so that bytes that are not one are
    refused where they are read. A large one (LARGE_REQUEST_BYTES, `wire/protocol.py`) has its
    arguments counted (MAX_CALL_FIELDS) and is read as a view: its target, and of its arguments
    those that fit in that many bytes together, in order, for the refs they carry. Parsing it whole
    held the pool server's loop for a second and took 1.5 GB of it for a request of many tiny
    values, and the router never decodes a value; the worker parses the rest, in the caller's turn.
    When the part read carries no ref, the arguments that do not fit are searched, as bytes
    (REF_SEARCH_BYTES of them), for refs of the `router`'s live workers (a ref id is its worker's id,
    a dot and a token): one worker found there counts as a ref the call carries (two or more: bytes
    that only look like refs, and none counts)."""
    if len(raw) < LARGE_REQUEST_BYTES:
        return parse_request(pb.CallRequest, raw, rpc, limit)
    view = read_large_call(raw, rpc, limit, pb.CallRequestView)
    head = pb.CallRequest(target=view.target)
    budget = LARGE_REQUEST_BYTES
    try:
        # (at most MAX_CALL_FIELDS of them: a small one after a large one is still read)
        unread: list[bytes] = []
        for arg in view.args:
            if len(arg) < budget:
                budget -= len(arg) + 2          # an empty one costs its tag and length
                head.args.add().MergeFromString(arg)
            else:
                unread.append(arg)
        for key, arg in view.kwargs.items():
            if len(arg) < budget:
                budget -= len(arg) + len(key) + 4
                head.kwargs[key].MergeFromString(arg)
            else:
                unread.append(arg)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise BridgeError.validation(f"{rpc}: the request is not a valid {pb.CallRequest.DESCRIPTOR.full_name} "
                                     f"({len(raw)} bytes): {exc}", parameter="request") from None
    if unread and router is not None and not payload_refs(head):
        found = router.named_in(unread)
        if len(found) == 1:        # (more than one: bytes that only look like refs; the worker will say)
            head.args.add().ref.id = found[0]
    return head


def read_route(metadata: Iterable[tuple[str, str | bytes]] | None, grpc_remaining_s: float | None,
               request: pb.CallRequest | None = None, identity: str = "", client: str = "") -> Route:
    opts = parse_metadata(metadata)
    session = session_key(identity, opts.session_id) if opts.session_sent else None
    refs = opts.refs
    if request is not None:
        carried = payload_refs(request)
        if carried:
            refs = tuple(dict.fromkeys((*refs, *carried)))
    now = time.monotonic()
    explicit = explicit_timeout(opts, grpc_remaining_s)
    if explicit is not None:
        return Route(opts, session, now + explicit, True, refs, client or identity)
    profile = PROFILES[opts.timeout_profile] if opts.timeout_profile else None
    deadline = now + profile.call_s if profile is not None and profile.call_s is not None else None
    return Route(opts, session, deadline, False, refs, client or identity)


_CONTAINERS = ("list", "tuple", "set", "frozenset")
REF_SEARCH_BYTES = 8 << 20    # of a large request's unread arguments, searched for refs by their bytes
REF_SEARCH_MATCHES = 64       # ... and the places there that look like one, checked at most
PAYLOAD_REF_SCAN = 1000       # values looked at per request; refs deeper than that need x-bridge-refs


def payload_refs(request: pb.CallRequest) -> list[str]:
    """The refs a request carries: its receiver, and refs among its arguments (their values are
    walked, not decoded; a packed list of ints or a tensor is one step). Clients need not list them
    in x-bridge-refs for the call to reach the worker that holds them."""
    found = []
    target = request.target
    if target.WhichOneof("receiver") == "ref":
        found.append(target.ref.id)
    todo = [*request.args, *request.kwargs.values()]
    budget = PAYLOAD_REF_SCAN
    while todo and budget:
        budget -= 1
        value = todo.pop()
        kind = value.WhichOneof("kind")
        # Only as many items as the budget has left are taken out of a container: a list of 30
        # million empty values was read whole (7 GB of the pool server, and a minute of its loop).
        if kind == "ref":
            found.append(value.ref.id)
        elif kind in _CONTAINERS:
            todo.extend(getattr(value, kind).items[:budget])
        elif kind == "map":
            for entry in value.map.entries[:budget]:
                todo.append(entry.key)
                todo.append(entry.value)
        elif kind == "record":
            todo.extend(f.value for f in value.record.fields[:budget])
    return found


def time_left(route: Route) -> float | None:
    """The timeout a call carries to its worker: what is left of the caller's own deadline after
    routing and queueing (None when the caller set none: the worker applies the profile)."""
    if not route.explicit_deadline or route.deadline is None:
        return None
    left = route.deadline - time.monotonic() - DEADLINE_MARGIN_S
    if left <= 0:
        raise BridgeError.timeout("deadline exceeded before the call reached a worker")
    return left


class Router:
    """All pools, and the index from worker id to worker that ref routing needs."""

    def __init__(self, pools: list[PoolConfig], default_pool: str) -> None:
        self.pools: dict[str, PoolRouter] = {p.name: PoolRouter(p) for p in pools}
        self.default_pool = default_pool
        self.backends: dict[str, Backend] = {}
        self.gone: dict[str, str] = {}       # ids of workers that died -> how (for "worker lost")
        self.accepting = True

    def pool(self, name: str | None) -> PoolRouter:
        p = self.pools.get(name or self.default_pool)
        if p is None:
            raise BridgeError(grpc.StatusCode.NOT_FOUND, "pool", f"no pool {quote(name)}; pools: {', '.join(self.pools)}",
                              reason="unknown pool", suggestions=list(self.pools))
        return p

    def add_backend(self, backend: Backend) -> None:
        self.backends[backend.id] = backend
        self.pools[backend.pool].add(backend)

    def remove_backend(self, backend: Backend, reason: str, message: str) -> None:
        self.backends.pop(backend.id, None)
        self.gone[backend.id] = message
        self.pools[backend.pool].remove(backend, reason, message)

    def named_in(self, parts: list[bytes], searched: int = REF_SEARCH_BYTES) -> list[str]:
        """A ref of each live worker whose refs the first `searched` bytes of `parts` hold: a Ref's
        id is a string field (tag 0x0a, its length, then the id) that is its worker's id, a dot and
        a token, the length saying exactly that much (so text that merely names a worker is not
        taken for a ref). One pass over the bytes, in C (bytes made to look like ids: ~6 ms per MiB)."""
        ids = sorted(self.backends, key=len, reverse=True)
        if not ids:
            return []
        # The token is matched here too, at most as long as the length byte allows, and must end
        # there: walking a run of token characters in Python took 0.5 s of the loop for 8 MiB of them.
        pattern = re.compile(rb"\x0a([\x01-\x7f])((" + b"|".join(re.escape(i.encode()) for i in ids) +
                             rb")\.[A-Za-z0-9_-]{1,126}+)(?![A-Za-z0-9_-])")
        found: dict[str, str] = {}      # worker id -> the first of its refs found
        looked = 0
        for part in parts:
            end = min(len(part), searched)
            searched -= end
            for match in pattern.finditer(part, 0, end):
                looked += 1         # (each is checked in Python: a few, however many the bytes hold)
                if looked > REF_SEARCH_MATCHES:
                    return list(found.values())
                length, ref, worker = match.groups()
                if length[0] == len(ref):       # the length covers the worker id, the dot, the token
                    found.setdefault(worker.decode(), ref.decode())
            if searched <= 0 or len(found) == len(ids):
                break
        return list(found.values())

    def ref_backend(self, refs: tuple[str, ...], listed: tuple[str, ...] = ()) -> Backend:
        """The one worker holding every ref the call uses. `listed`: those the caller named in
        x-bridge-refs, which a refusal names as that header's (the others are the request's own)."""
        for ref in refs:      # (whether a well-formed id is a ref is its worker's to judge)
            worker, dot, token = ref.partition(".")
            if not (worker and dot and token):
                shown = f"metadata {MD_REFS}: " if ref in listed else ""
                raise BridgeError.validation(f"{shown}{quote(ref, 80)} is not a ref id (a Ref's id: its worker's "
                                             f"id, a dot and a token)", parameter=MD_REFS if ref in listed else "ref")
        holders: dict[str, str] = {}
        for ref in refs:
            holders.setdefault(ref.partition(".")[0], ref)

        def where(*of: str) -> str:
            return MD_REFS if any(r in listed for r in of) else "ref"
        if len(holders) > 1:
            raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "ref",
                              f"the call uses refs held by different workers "
                              f"({', '.join(quote(w, 40) for w in sorted(holders)[:5])}): "
                              f"{', '.join(quote(r) for r in list(holders.values())[:5])}; a call can only use refs "
                              f"of one worker", reason="refs on different workers", parameter=where(*holders.values()))
        (worker_id, ref), = holders.items()
        b = self.backends.get(worker_id)
        if b is not None:
            return b
        if worker_id in self.gone:
            raise pool_error(grpc.StatusCode.UNAVAILABLE,
                             f"worker lost: ref {quote(ref)} was held by worker {worker_id}, which is gone "
                             f"({self.gone[worker_id]}); its refs are lost", "worker lost", "worker")
        said = f" (in {MD_REFS})" if ref in listed else ""
        raise BridgeError(grpc.StatusCode.NOT_FOUND, "ref",
                          f"ref {quote(ref)}{said}: no worker {quote(worker_id, 40)} in this server (workers: "
                          f"{', '.join(self.backends) or 'none'})", reason="unknown worker", parameter=where(ref))

    def plan(self, route: Route) -> Plan:
        """Decides where the call may run (the rules in the module docstring); reserves nothing."""
        if not self.accepting:
            raise pool_error(grpc.StatusCode.UNAVAILABLE, "the server is shutting down", "shutting down")
        opts, session = route.opts, route.session
        named = self.pool(opts.pool)          # an unknown pool is refused even for ref calls
        if route.refs:
            backend = self.ref_backend(route.refs, opts.refs)
            pool = self.pools[backend.pool]
            if opts.rank is not None and backend.index != opts.rank:
                # (a call runs where its refs are: run on rank 1 for a caller who named rank 0, it
                # answered as if rank 0 had)
                raise BridgeError.validation(
                    f"metadata {MD_RANK}: {opts.rank} names rank {opts.rank}, but ref {quote(route.refs[0])} is "
                    f"held by rank {backend.index} of pool {pool.name!r}, and a call runs where its refs are: "
                    f"name rank {backend.index}, or none", parameter=MD_RANK)
            mode = opts.affinity or pool.config.affinity
            pin = session is not None and pool.pinned(session) is None
            return Plan(pool, backend, None, mode == "strict_fail_fast", f"ref {quote(route.refs[0])}",
                        session if pin else None)
        pool = named
        mode = opts.affinity or pool.config.affinity
        pinned = pool.pinned(session) if session is not None else None
        if opts.rank is not None:
            # A session first seen here is pinned to that rank's worker, as one first seen with a ref is
            # to the ref's: its refs are there, and its next calls without a rank must find them.
            return Plan(pool, pool.rank_backend(opts.rank), None, mode == "strict_fail_fast", f"rank {opts.rank}",
                        session if session is not None and pinned is None else None)
        if pinned is not None and session is not None and pinned.state != READY:
            # Dead or draining (being recycled): hint moves the session; the strict modes stay with a
            # draining worker (it still serves them) and fail for a dead one.
            if mode == "hint":
                pool.unpin(session)
                pinned = None
            elif pinned.state == DEAD:
                raise pool_error(grpc.StatusCode.UNAVAILABLE,
                                 f"worker lost: session {session!r} was pinned to worker {pinned.id}, which is gone "
                                 f"({pinned.exit_reason}); affinity {mode} will not move it (release the session "
                                 f"to start it again on another worker)", "worker lost", "worker")
        if pinned is None:
            return Plan(pool, None, None, False, "", session)
        if mode == "hint":
            return Plan(pool, None, pinned, False, "", None)
        return Plan(pool, pinned, None, mode == "strict_fail_fast", f"session {session!r}", None)

    @staticmethod
    def placed(plan: Plan, backend: Backend, client: str = "") -> None:
        """The call (`client`'s) got its slot: a session seen for the first time is pinned where it runs."""
        if plan.pin is not None and plan.pool.pinned(plan.pin) is None:
            plan.pool.pin(plan.pin, backend, client)

    def reader_stall_s(self) -> float:
        """The bound on a caller that reads nothing of a stream whose calls span pools (Multiplex):
        the longest of the pools' reader_stall_s (0, none, if any pool sets none)."""
        bounds = [p.config.reader_stall_s for p in self.pools.values()]
        return 0.0 if not bounds or min(bounds) <= 0 else max(bounds)

    def any_backend(self, pool_name: str | None) -> Backend:
        """A live worker for calls that need no slot (Describe)."""
        pool = self.pool(pool_name)
        live = [b for b in pool.backends if b.state == READY]
        if not live:
            raise pool.unavailable_error() if pool.unavailable else pool_error(
                grpc.StatusCode.UNAVAILABLE, f"pool {pool.name!r} has no ready worker yet", "no live worker")
        return min(live, key=lambda b: b.in_flight)
