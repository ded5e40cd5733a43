"""The ref registry: Python objects held by a worker on behalf of its clients.

A ref belongs to the client identity that created it (with authentication on; "" for everyone
without): another identity can neither use nor release it (PERMISSION_DENIED). Within an identity a
ref is owned by a session (for bulk release and caps) but is not locked to it: any session of that
identity that presents the id may use it, so refs can pass between Elixir processes. Without
authentication every client's session of a name is the same one, so a session released by name
ends only the refs the releasing connection made in it (where connections can be told apart). Ids are
unguessable and start with the worker id, so whoever holds an id can tell which worker holds the
object. When a ref goes away its id leaves a tombstone, so a late user is told why it is gone rather
than "unknown". Limits bound what clients make a worker hold: refs per session (the oldest go),
sessions per worker and refs per identity (refused: RESOURCE_EXHAUSTED, naming the limit), and the
memory of the tensors an identity's refs hold: a ref to an object built from a 64 MiB tensor costs
one ref of 100,000 but 64 MiB of the worker's memory, and the worker is every client's.

The registry is touched only from the worker's event loop thread, so it needs no locks.
"""

from __future__ import annotations

import secrets
import sys
import time
import types
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError, clip

Finalizer = Callable[[object], None]


@dataclass
class RefEntry:
    id: str
    obj: object
    owner: str                    # the client identity that created it
    session_id: str
    type_name: str
    exclusive: bool               # methods of this object touch process-wide state
    created: float = field(default_factory=time.monotonic)
    last_used: float = field(default_factory=time.monotonic)
    pinned: bool = False          # published objects: never evicted by cap or TTL
    expires: float | None = None  # time.monotonic() when it goes, however it is used
    connection: str = ""          # without authentication, the connection whose call created it


class RefGone(BridgeError):
    pass


def held_bytes(obj: object, limit: int = 10_000) -> int:
    """The bytes of the tensors (and arrays), text and containers obj holds, its own or its parts'
    a few levels down: what a ref to it keeps in memory, within what counting `limit` objects finds.
    A view counts its whole storage (it keeps it alive), and a storage counts once. Only instance
    dicts, slots and containers are looked into: no attribute lookup that could run an object's code."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    total = 0
    storages: set[int] = set()
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(obj, 0)]
    while todo and len(seen) < limit:
        x, depth = todo.pop()
        if id(x) in seen or isinstance(x, _ATOMS):
            if type(x) in _DATA and id(x) not in seen:     # text and bytes a client sent, kept
                seen.add(id(x))
                total += sys.getsizeof(x)
            continue
        seen.add(id(x))
        if torch is not None and isinstance(x, torch.Tensor):
            try:
                st = x.untyped_storage()
                if st.data_ptr() not in storages:
                    storages.add(st.data_ptr())
                    total += st.nbytes()
            except Exception:   # a meta or sparse tensor: no storage of its own
                pass
            continue
        if numpy is not None and isinstance(x, numpy.ndarray):
            total += x.nbytes
            continue
        if depth >= 4:
            continue
        if type(x) in (dict, list, tuple, set, frozenset):
            total += sys.getsizeof(x)      # its slots: a list of a million ints is 8 MB before any int
            parts = list(x.values()) if type(x) is dict else list(x)   # type: ignore[attr-defined, call-overload]
        else:
            parts = list(object.__getattribute__(x, "__dict__").values()) if _has_dict(x) else []
            for klass in type(x).__mro__:
                slots = klass.__dict__.get("__slots__", ())
                for name in (slots,) if isinstance(slots, str) else slots:
                    member = klass.__dict__.get(name)
                    if isinstance(member, types.MemberDescriptorType):
                        try:
                            parts.append(member.__get__(x, klass))
                        except AttributeError:   # an empty slot
                            pass
        todo.extend((v, depth + 1) for v in parts[:limit])
    return total


_DATA = frozenset({str, bytes, bytearray})
_ATOMS = (type(None), str, bytes, bytearray, int, float, complex, bool, type, types.ModuleType,
          types.FunctionType, types.BuiltinFunctionType, types.MethodType)


def _has_dict(x: object) -> bool:
    try:
        return isinstance(object.__getattribute__(x, "__dict__"), dict)
    except (AttributeError, TypeError):
        return False


def _type_name(obj: object) -> str:
    t = type(obj)
    return f"{t.__module__}.{t.__qualname__}"


class RefRegistry:
    """Refs by id, grouped by (owner, session); evicts by per-session cap (oldest first) and idle TTL."""

    def __init__(self, worker_id: str, *, session_cap: int = 10_000, idle_ttl_s: float | None = None,
                 finalize: Finalizer | None = None, tombstones: int = 100_000, max_sessions: int = 10_000,
                 max_refs_per_client: int = 100_000, max_ref_bytes_per_client: int = 1 << 30) -> None:
        self.worker_id = worker_id
        self.session_cap = session_cap
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions = max_sessions
        self.max_refs_per_client = max_refs_per_client
        self.max_ref_bytes_per_client = max_ref_bytes_per_client
        self._bytes_per_owner: dict[str, int] = {}
        self._sessions_per_owner: dict[str, int] = {}
        self._charged: dict[int, tuple[str, int]] = {}   # id(obj) -> who pays for its tensors, how much
        self._finalize = finalize
        self._refs: dict[str, RefEntry] = {}
        self._sessions: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._per_owner: dict[str, int] = {}
        self._holders: dict[int, int] = {}   # id(obj) -> number of live refs to it
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._max_tombstones = tombstones

    def __len__(self) -> int:
        return len(self._refs)

    def sessions(self) -> int:
        return len(self._sessions)

    def put(self, obj: object, session_id: str, *, owner: str = "", exclusive: bool = False, pinned: bool = False,
            ref_id: str | None = None, expires_in: float | None = None, connection: str = "") -> RefEntry:
        key = (owner, session_id)
        owned = self._sessions.get(key)
        if owned is None:
            if len(self._sessions) >= self.max_sessions:
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id} holds {len(self._sessions):,} sessions, its limit "
                                  f"(max_sessions): release a session first", reason="max_sessions")
            share = self.max_sessions - self.max_sessions // 4
            if owner and self._sessions_per_owner.get(owner, 0) >= share:   # identities: one may not take all
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id} holds {share:,} sessions of this client, the most one "
                                  f"client may hold (max_sessions {self.max_sessions:,}: the last quarter is kept "
                                  f"for other clients): release a session first", reason="max_sessions")
        if self._per_owner.get(owner, 0) >= self.max_refs_per_client:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                              f"worker {self.worker_id} holds {self.max_refs_per_client:,} refs of this client, its "
                              f"limit (max_refs_per_client): release some first", reason="max_refs_per_client")
        nbytes = 0
        if not pinned and id(obj) not in self._holders and self.max_ref_bytes_per_client:
            nbytes = held_bytes(obj)
            held = self._bytes_per_owner.get(owner, 0)
            if nbytes and held + nbytes > self.max_ref_bytes_per_client:
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id} holds {held:,} bytes (tensors, text, containers) in this "
                                  f"client's refs; a ref to this {_type_name(obj)} ({nbytes:,} bytes) would pass "
                                  f"its limit of {self.max_ref_bytes_per_client:,} (max_ref_bytes_per_client): "
                                  f"release some first", reason="max_ref_bytes_per_client")
            if nbytes:
                self._bytes_per_owner[owner] = held + nbytes
                self._charged[id(obj)] = (owner, nbytes)
        entry = RefEntry(ref_id or f"{self.worker_id}.{secrets.token_urlsafe(18)}", obj, owner, session_id,
                         _type_name(obj), exclusive, pinned=pinned, connection="" if owner else connection)
        if expires_in and not pinned:
            entry.expires = entry.created + expires_in
        self._refs[entry.id] = entry
        self._holders[id(obj)] = self._holders.get(id(obj), 0) + 1
        self._per_owner[owner] = self._per_owner.get(owner, 0) + 1
        if owned is None:
            owned = self._sessions[key] = OrderedDict()
            self._sessions_per_owner[owner] = self._sessions_per_owner.get(owner, 0) + 1
        owned[entry.id] = None
        while len(owned) > self.session_cap:
            oldest = next(iter(owned))
            self._drop(oldest, f"evicted: session {session_id!r} exceeded its cap of {self.session_cap} refs")
        return entry

    def get(self, ref_id: str, owner: str | None = None) -> RefEntry:
        """The ref; a client (`owner` given) may use only its own identity's."""
        entry = self._refs.get(ref_id)
        if entry is None:
            raise self._gone_error(ref_id)
        if owner is not None and entry.owner != owner:
            raise self._foreign(ref_id)
        entry.last_used = time.monotonic()
        return entry

    def owned(self, owner: str) -> list[RefEntry]:
        return [e for e in self._refs.values() if e.owner == owner]

    def release(self, ref_ids: list[str], owner: str | None = None) -> int:
        foreign = [r for r in ref_ids if r in self._refs and owner is not None and self._refs[r].owner != owner]
        if foreign:
            raise self._foreign(foreign[0])
        return sum(self._drop(r, "released by the client") for r in ref_ids if r in self._refs)

    def release_session(self, session_id: str, owner: str = "", connection: str | None = None) -> int:
        """Releases a session's refs. Without authentication (`owner` ""), every client's session of a
        name is one, so a `connection` given releases only the refs its own calls made there: a
        stranger naming the session ("default", say) does not end everyone's."""
        if connection is not None and not owner:
            held: Mapping[str, None] = self._sessions.get((owner, session_id)) or {}
            mine = [r for r in held if self._refs[r].connection == connection]
            return sum(self._drop(r, f"released with its session {session_id!r}") for r in mine)
        gone: dict[str, None] | None = self._sessions.pop((owner, session_id), None)
        if gone is None:
            return 0
        self._session_gone(owner)
        return sum(self._drop(r, f"released with its session {session_id!r}") for r in list(gone))

    def _session_gone(self, owner: str) -> None:
        left = self._sessions_per_owner.pop(owner, 1) - 1
        if left > 0:
            self._sessions_per_owner[owner] = left

    def sweep(self, now: float | None = None) -> int:
        """Evicts refs idle for longer than the TTL, and those past their expiry; called periodically
        by the worker."""
        now = time.monotonic() if now is None else now
        due = [e for e in self._refs.values() if e.expires is not None and e.expires <= now]
        gone = sum(self._drop(e.id, f"expired: what it held ends {e.expires - e.created:g} s after it was made "
                                    f"(unread_request_s)") for e in due if e.expires is not None)
        if self.idle_ttl_s is None:
            return gone
        cutoff = now - self.idle_ttl_s
        stale = [e.id for e in self._refs.values() if e.last_used < cutoff and not e.pinned]
        return gone + sum(self._drop(r, f"expired: idle for more than {self.idle_ttl_s:g} s") for r in stale)

    def close(self) -> None:
        for ref_id in list(self._refs):
            self._drop(ref_id, "the worker shut down")

    def _drop(self, ref_id: str, reason: str) -> bool:
        entry = self._refs.pop(ref_id, None)
        if entry is None:
            return False
        key = (entry.owner, entry.session_id)
        owned = self._sessions.get(key)
        if owned is not None:
            owned.pop(ref_id, None)
            if not owned:
                del self._sessions[key]
                self._session_gone(entry.owner)
        left_owned = self._per_owner.pop(entry.owner, 1) - 1
        if left_owned:
            self._per_owner[entry.owner] = left_owned
        self._gone[ref_id] = reason
        while len(self._gone) > self._max_tombstones:
            self._gone.popitem(last=False)
        left = self._holders.pop(id(entry.obj)) - 1
        if left:
            self._holders[id(entry.obj)] = left
        else:
            charged = self._charged.pop(id(entry.obj), None)
            if charged is not None:     # refs never pass between identities: its first owner pays
                owner, nbytes = charged
                remaining = self._bytes_per_owner.pop(owner, 0) - nbytes
                if remaining > 0:
                    self._bytes_per_owner[owner] = remaining
            if self._finalize is not None:
                self._finalize(entry.obj)   # the last ref to this object is gone
        return True

    def held_bytes(self, owner: str) -> int:
        """Tensor bytes charged to an identity's refs."""
        return self._bytes_per_owner.get(owner, 0)

    def _foreign(self, ref_id: str) -> BridgeError:
        return BridgeError(grpc.StatusCode.PERMISSION_DENIED, "ref",
                           f"ref {clip(ref_id, 80)} belongs to another client: a ref is used and released only by "
                           f"the identity that made it", reason="not yours", parameter=clip(ref_id, 80))

    def _gone_error(self, ref_id: str) -> RefGone:
        reason = self._gone.get(ref_id)
        if reason is not None:
            return RefGone(grpc.StatusCode.NOT_FOUND, "ref", f"ref {ref_id} is gone: {reason}",
                           reason="ref gone", parameter=ref_id)
        ref_id = clip(ref_id, 80)
        if not ref_id.startswith(self.worker_id + "."):
            return RefGone(grpc.StatusCode.NOT_FOUND, "ref",
                           f"ref {ref_id} is not held by worker {self.worker_id} (a pool server sends a call to "
                           f"the worker of the refs its request carries and of those named in x-bridge-refs)",
                           reason="wrong worker",
                           parameter=ref_id)
        return RefGone(grpc.StatusCode.NOT_FOUND, "ref", f"ref {ref_id} is unknown to worker {self.worker_id}",
                       reason="unknown ref", parameter=ref_id)
