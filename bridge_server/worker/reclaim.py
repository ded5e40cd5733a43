"""What the worker takes back by itself from clients that cannot be told apart: refs made without an
identity that nobody uses any more. Without authentication a ref is everyone's ("" identity), and
only the connection that made it could release it by session, so what a client left behind by going
away (an engine of 2 GB, process groups of 13 sockets each, an entered `suppress_stdout`) stayed for
the worker's life and kept every later client out. The worker's sweep calls these; an identity's refs
are its own to release and are never taken back here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from adapters.spec import Policy
from bridge_server.wire.protocol import host_of
from bridge_server.worker.catalog import Catalog
from bridge_server.worker.peers import peer_endpoints
from bridge_server.worker.refs import RefEntry, RefRegistry

__all__ = ["end_idle_engines", "end_orphans", "orphan_candidates"]


def end_idle_engines(refs: RefRegistry, catalog: Catalog, policy: Policy, now: float | None = None) -> int:
    """Two engines made by connections that had exited kept every later client from making one, as
    the engine limit is every unauthenticated client's together. So an engine made without an
    identity that no call has named for `idle_engine_s`, and that holds no live request, is released
    (its last ref gone, it shuts down); its ref's error says why."""
    idle = policy.idle_engine_s
    return _release_unused(refs, catalog, idle, now, lambda e: not e.owner and catalog.lifecycle(e.obj) is not None,
                           f"released: an engine made without an identity, that no call named for {idle:g} s and "
                           f"that held no live request (idle_engine_s)")


def orphan_candidates(refs: RefRegistry, policy: Policy, now: float | None = None) -> bool:
    """Whether any ref could be an orphan (`end_orphans`): made without an identity over a TCP
    connection, and unused for `orphan_ref_s`. Cheap, so the TCP tables are read only then."""
    grace = policy.orphan_ref_s
    if grace <= 0:
        return False
    now = time.monotonic() if now is None else now
    return any(not e.owner and peer_endpoints(e.connection) for e in refs.unused_since(now - grace))


# How long a ref of a closed connection goes unused before it is taken back, where its host has been
# refused a ref (or its bytes) for its share: what a host's closed connections left counted in the
# share of its live ones for `orphan_ref_s` (an hour), and a stranger's 75,000 refs made and left kept
# every client of its host from any ref for that long.
PRESSED_ORPHAN_S = 10.0


def end_orphans(refs: RefRegistry, catalog: Catalog, policy: Policy, peers: set[str],
                now: float | None = None, pressed: frozenset[str] | set[str] = frozenset()) -> int:
    """A ref made without an identity whose maker's connection is no longer open (`peers`: the open
    TCP endpoints, `peers.open_peers`) and that no call has used for `orphan_ref_s` is released, and
    its ref's error says why; of the hosts `pressed` (refused for their share), those unused for
    PRESSED_ORPHAN_S. A ref another connection goes on using stays."""
    def orphaned(entry: RefEntry) -> bool:
        ends = peer_endpoints(entry.connection) if not entry.owner else ()
        return bool(ends) and not any(end in peers for end in ends)
    grace = policy.orphan_ref_s
    gone = _release_unused(refs, catalog, grace, now, orphaned, f"released: made without an identity by a "
                                                                f"connection that has closed, and unused for "
                                                                f"{grace:g} s since (orphan_ref_s)")
    if pressed and grace > 0:
        soon = min(grace, PRESSED_ORPHAN_S)
        gone += _release_unused(refs, catalog, soon, now,
                                lambda e: orphaned(e) and host_of(e.connection) in pressed,
                                f"released: made without an identity by a connection that has closed, unused for "
                                f"{soon:g} s since, while its host's live connections were refused refs for "
                                f"its share (max_refs_per_client)")
    return gone


def _release_unused(refs: RefRegistry, catalog: Catalog, idle_s: float, now: float | None,
                    picked: Callable[[RefEntry], bool], reason: str) -> int:
    """Releases the refs `picked` of those no call has used for `idle_s` (0: none); an engine still
    working on a request is counted from when its work ends."""
    if idle_s <= 0:
        return 0
    now = time.monotonic() if now is None else now
    gone = 0
    for entry in refs.unused_since(now - idle_s):
        if not picked(entry):
            continue
        lifecycle = catalog.lifecycle(entry.obj)
        if lifecycle is not None and lifecycle.busy is not None and lifecycle.busy(entry.obj):
            entry.last_used = now          # in use: counted from when its work ends
            continue
        gone += refs.evict(entry.id, reason)
    return gone
