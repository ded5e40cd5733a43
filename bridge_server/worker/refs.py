"""The ref registry: Python objects held by a worker on behalf of its clients.

A ref is owned by a session (for bulk release and caps) but is not locked to it: any session that
presents the id may use it, so refs can pass between Elixir processes. Ids are unguessable and start
with the worker id, so whoever holds an id can tell which worker holds the object. When a ref goes
away its id leaves a tombstone, so a late user is told why it is gone rather than "unknown".

The registry is touched only from the worker's event loop thread, so it needs no locks.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError

Finalizer = Callable[[object], None]


@dataclass
class RefEntry:
    id: str
    obj: object
    session_id: str
    type_name: str
    exclusive: bool               # methods of this object touch process-wide state
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False          # published objects: never evicted by cap or TTL


class RefGone(BridgeError):
    pass


def _type_name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class RefRegistry:
    """Refs by id, grouped by session; evicts by per-session cap (oldest first) and idle TTL."""

    def __init__(self, worker_id: str, *, session_cap: int = 10_000, idle_ttl_s: float | None = None,
                 finalize: Finalizer | None = None, tombstones: int = 100_000) -> None:
        self.worker_id = worker_id
        self.session_cap = session_cap
        self.idle_ttl_s = idle_ttl_s
        self._finalize = finalize
        self._refs: dict[str, RefEntry] = {}
        self._sessions: dict[str, OrderedDict[str, None]] = {}
        self._holders: dict[int, int] = {}   # id(obj) -> number of live refs to it
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._max_tombstones = tombstones

    def __len__(self) -> int:
        return len(self._refs)

    def sessions(self) -> int:
        return len(self._sessions)

    def put(self, obj: object, session_id: str, *, exclusive: bool = False, pinned: bool = False,
            ref_id: str | None = None) -> RefEntry:
        entry = RefEntry(ref_id or f"{self.worker_id}.{secrets.token_urlsafe(18)}", obj, session_id,
                         _type_name(obj), exclusive, pinned=pinned)
        self._refs[entry.id] = entry
        self._holders[id(obj)] = self._holders.get(id(obj), 0) + 1
        owned = self._sessions.setdefault(session_id, OrderedDict())
        owned[entry.id] = None
        while len(owned) > self.session_cap:
            oldest = next(iter(owned))
            self._drop(oldest, f"evicted: session {session_id!r} exceeded its cap of {self.session_cap} refs")
        return entry

    def get(self, ref_id: str) -> RefEntry:
        entry = self._refs.get(ref_id)
        if entry is None:
            raise self._gone_error(ref_id)
        entry.last_used = time.monotonic()
        return entry

    def release(self, ref_ids: list[str]) -> int:
        return sum(self._drop(r, "released by the client") for r in ref_ids if r in self._refs)

    def release_session(self, session_id: str) -> int:
        owned: dict[str, None] = self._sessions.pop(session_id, OrderedDict())
        return sum(self._drop(r, f"released with its session {session_id!r}") for r in list(owned))

    def sweep(self, now: float | None = None) -> int:
        """Evicts refs idle for longer than the TTL; called periodically by the worker."""
        if self.idle_ttl_s is None:
            return 0
        cutoff = (now or time.monotonic()) - self.idle_ttl_s
        stale = [e.id for e in self._refs.values() if e.last_used < cutoff and not e.pinned]
        return sum(self._drop(r, f"expired: idle for more than {self.idle_ttl_s:g} s") for r in stale)

    def close(self) -> None:
        for ref_id in list(self._refs):
            self._drop(ref_id, "the worker shut down")

    def _drop(self, ref_id: str, reason: str) -> bool:
        entry = self._refs.pop(ref_id, None)
        if entry is None:
            return False
        owned = self._sessions.get(entry.session_id)
        if owned is not None:
            owned.pop(ref_id, None)
            if not owned:
                del self._sessions[entry.session_id]
        self._gone[ref_id] = reason
        while len(self._gone) > self._max_tombstones:
            self._gone.popitem(last=False)
        left = self._holders.pop(id(entry.obj)) - 1
        if left:
            self._holders[id(entry.obj)] = left
        elif self._finalize is not None:
            self._finalize(entry.obj)   # the last ref to this object is gone
        return True

    def _gone_error(self, ref_id: str) -> RefGone:
        reason = self._gone.get(ref_id)
        if reason is not None:
            return RefGone(grpc.StatusCode.NOT_FOUND, "ref", f"ref {ref_id} is gone: {reason}",
                           reason="ref gone", parameter=ref_id)
        if not ref_id.startswith(self.worker_id + "."):
            return RefGone(grpc.StatusCode.NOT_FOUND, "ref",
                           f"ref {ref_id} is not held by worker {self.worker_id}", reason="wrong worker",
                           parameter=ref_id)
        return RefGone(grpc.StatusCode.NOT_FOUND, "ref", f"ref {ref_id} is unknown to worker {self.worker_id}",
                       reason="unknown ref", parameter=ref_id)
