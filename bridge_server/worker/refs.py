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
one ref of 100,000 but 64 MiB of the worker's memory, and the worker is every client's. The same for
the files an object holds open (a process group ~13 sockets): the worker's room for them is every
client's, authenticated or not, so a host (an identity) holds at most three quarters of what the
others leave of it (one identity's 381 groups refused every other identity's calls that make anything).

Without authentication the clients are one identity, and each limit is theirs together; so each
connection takes only its share of it, as the engine's fair share does: a host at most three
quarters of what the other hosts left, and a connection the same of its host's (one connection
that made 100,000 refs and left shut every other client out of making any, for good). A session's
cap bounds each payer's refs in it, and evicts only the adder's own oldest: a stranger filling the
shared `default` session evicted every other connection's refs in it.

The registry is touched only from the worker's event loop thread, so it needs no locks.
"""

from __future__ import annotations

import collections
import math
import secrets
import sys
import time
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError, clip, quote
from bridge_server.wire.protocol import host_of

Finalizer = Callable[[object], None]
SHARE = 0.75     # without an identity: of what the others left, the most a host, or a host's connection, holds


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
    payer: str = ""               # whose limits it counts against (`payer_of`)
    host: str | None = None       # without an identity: the payer's host


def payer_of(owner: str, connection: str) -> tuple[str, str | None]:
    """Whom a ref counts against: its identity, or, without one, its connection, within its host."""
    if owner:
        return owner, None
    return "\0" + connection, host_of(connection)


@dataclass
class Tally:
    """One kind of holding (refs, bytes, sessions) per payer; and, for payers without an identity,
    per host and in all, since their limit is one for them all."""
    by_payer: dict[str, int] = field(default_factory=dict)
    by_host: dict[str, int] = field(default_factory=dict)
    anonymous: int = 0

    def held(self, payer: str) -> int:
        return self.by_payer.get(payer, 0)

    def add(self, payer: str, host: str | None, n: int) -> None:
        _bump(self.by_payer, payer, n)
        if host is not None:
            _bump(self.by_host, host, n)
            self.anonymous += n

    def refusal(self, payer: str, host: str | None, n: int, limit: int, unit: str) -> str:
        """Why `payer` may not hold `n` more under `limit` ("": it may). An identity has the limit
        to itself; the clients without one have it together, each connection its share."""
        mine = self.held(payer)
        if host is None:
            return "" if mine + n <= limit else f"this client holds {mine:,} {unit}, and its limit is {limit:,}"
        if self.anonymous + n > limit:
            return f"clients without an identity hold {self.anonymous:,} {unit} together, and their limit is {limit:,}"
        host_held = self.by_host.get(host, 0)
        left = limit - (self.anonymous - host_held)
        host_cap = math.ceil(SHARE * left) if left > 0 else 0     # rounded up: a host alone takes a small limit whole
        if host_held + n > host_cap:      # connections cost nothing: however many, a host holds its share
            return (f"this connection's host holds {host_held:,} {unit}, its share: without authentication the "
                    f"limit ({limit:,}) is every client's, of which a host holds at most {SHARE:.0%} of what the "
                    f"other hosts left ({int(host_cap):,} for this one)")
        cap = max(SHARE * (host_cap - (host_held - mine)), 1)
        if mine + n <= cap:
            return ""
        return (f"this connection holds {mine:,} {unit}, its share: without authentication the limit "
                f"({limit:,}) is every client's, of which a host holds at most {SHARE:.0%} of what the other hosts "
                f"left ({int(host_cap):,} for this one, which holds {host_held:,}), and a connection the same of its "
                f"host's")


def _bump(counts: dict[str, int], key: str, n: int) -> None:
    left = counts.get(key, 0) + n
    if left > 0:
        counts[key] = left
    else:
        counts.pop(key, None)


def _files_holder(owner: str, connection: str) -> str:
    """Whose share of the worker's open files an object counts against: its identity's, or without
    one its connection's host's (connections cost nothing; hosts do)."""
    return "\0" + owner if owner else host_of(connection)


class RefGone(BridgeError):
    pass


MAX_OBJECTS = 10_000      # objects (not containers) whose attributes held_bytes looks into
MAX_OBJECT_DEPTH = 4      # ... and how far down through objects
MAX_PARTS = 100_000       # parts (not text or numbers) held_bytes counts in all, past which it refuses


class TooManyParts(BridgeError):
    pass


def held_bytes(obj: object, published: Container[int] = ()) -> int:
    """The bytes of the tensors (and arrays), text and containers obj holds, its own or its parts':
    what a ref to it keeps in memory. A view counts its whole storage (it keeps it alive), and a
    storage counts once. Only instance dicts, slots and containers are looked into: no attribute
    lookup that could run an object's code.

    Containers are followed to any depth, for that is how a client's data nests: a walk that stopped
    four levels down, or after 10,000 parts, left text nested five deep, or behind 10,001 empty
    lists, uncounted, and a stranger's refs held 1.4 GB past a 1 GiB bound. A container of text or
    numbers only is counted in one pass; other parts one by one, MAX_PARTS at most (~0.1 s of the
    event loop): an object of more is refused (TooManyParts), as no documented record needs them.
    An object's own attributes are looked into MAX_OBJECT_DEPTH levels down and MAX_OBJECTS at most
    (an engine's graph is larger than anything a client sends, and it is the worker's). The server's
    `published` objects (their ids) are not the client's, and are not looked into. What other refs
    hold is counted again: charged to them only, it went uncounted once they were released while
    this object still kept it (300 such refs held 1.1 GB past the bound)."""
    torch = sys.modules.get("torch")
    numpy = sys.modules.get("numpy")
    total = objects = 0
    storages: set[int] = set()
    seen: set[int] = set()
    todo: list[tuple[object, int]] = [(obj, 0)]
    while todo:
        x, depth = todo.pop()
        if id(x) in seen or isinstance(x, _ATOMS):
            if type(x) in _DATA and id(x) not in seen:     # text and bytes a client sent, kept
                seen.add(id(x))
                total += sys.getsizeof(x)
            continue
        if x is not obj and id(x) in published:
            continue
        seen.add(id(x))
        if len(seen) > MAX_PARTS:
            raise TooManyParts(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                               f"this {_type_name(obj)} holds more than {MAX_PARTS:,} parts, more than the worker "
                               f"counts for a ref (max_ref_bytes_per_client)", reason="max_ref_bytes_per_client")
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
        if type(x) in (dict, list, tuple, set, frozenset):
            total += sys.getsizeof(x)      # its slots: a list of a million ints is 8 MB before any int
            parts = list(x.values()) if type(x) is dict else list(x)   # type: ignore[attr-defined, call-overload]
            if type(x) is dict:
                parts.extend(x)            # its keys: text a client sent too
            kinds = set(map(type, parts))
            if kinds <= _NUMBERS:          # held in the slots counted
                continue
            if kinds <= _DATA:             # counted in one pass in C (a million strings: ~50 ms)
                total += sum(map(sys.getsizeof, parts))
                continue
            todo.extend((v, depth) for v in parts)
            continue
        if depth >= MAX_OBJECT_DEPTH or objects >= MAX_OBJECTS:
            continue
        objects += 1
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
        todo.extend((v, depth + 1) for v in parts)
    return total


_DATA = frozenset({str, bytes, bytearray})
_NUMBERS = frozenset({int, float, bool, type(None)})
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
    """Refs by id, grouped by (owner, session); evicts by per-session cap (a payer's oldest first) and idle TTL."""

    def __init__(self, worker_id: str, *, session_cap: int = 10_000, idle_ttl_s: float | None = None,
                 finalize: Finalizer | None = None, tombstones: int = 100_000, max_sessions: int = 10_000,
                 max_refs_per_client: int = 100_000, max_ref_bytes_per_client: int = 1 << 30,
                 files_cap: Callable[[], int | None] = lambda: None,
                 files_open: Callable[[], int | None] = lambda: None) -> None:
        self.worker_id = worker_id
        self.session_cap = session_cap
        self.idle_ttl_s = idle_ttl_s
        self.max_sessions = max_sessions
        self.max_refs_per_client = max_refs_per_client
        self.max_ref_bytes_per_client = max_ref_bytes_per_client
        self._bytes = Tally()
        self.files_cap = files_cap     # the open files calls that make things may bring the worker to (None: no bound)
        self.files_open = files_open   # the files the worker holds open now
        self._files: dict[str, int] = {}      # by who holds them (`_files_holder`)
        # The objects charged for files, by id: (holder, files), until the object itself is gone (its
        # finalizer queues its id in `_files_freed`), however many refs to it came and went, and
        # whatever else holds it: a second ref minted by a read, or an object built around it, kept a
        # process group's sockets open after the ref charged for them was released.
        self._file_charges: dict[int, tuple[str, int]] = {}
        self._files_freed: collections.deque[int] = collections.deque()
        self._charged_until_released: set[int] = set()   # objects no finalizer can watch: until their last ref goes
        self._session_tally = Tally()
        self._session_payer: dict[tuple[str, str], tuple[str, str | None]] = {}   # who made each session
        self._charged: dict[int, tuple[str, str | None, int]] = {}   # id(obj) -> who pays for its tensors, how much
        self._published: set[int] = set()   # ids of the server's objects: no client's bytes, never counted
        self._finalize = finalize
        self._refs: dict[str, RefEntry] = {}
        self._sessions: dict[tuple[str, str], OrderedDict[str, None]] = {}
        self._in_session: dict[tuple[tuple[str, str], str], OrderedDict[str, None]] = {}   # (session, payer): its refs
        self._count = Tally()
        # Hosts refused a ref, or its bytes, for their share since the sweep last asked (`pressed`):
        # what closed connections of theirs left counts in it until it is reclaimed.
        self._pressed: set[str] = set()
        self._holders: dict[int, int] = {}   # id(obj) -> number of live refs to it
        self._gone: OrderedDict[str, str] = OrderedDict()
        self._max_tombstones = tombstones

    def __len__(self) -> int:
        return len(self._refs)

    def sessions(self) -> int:
        return len(self._sessions)

    def put(self, obj: object, session_id: str, *, owner: str = "", exclusive: bool = False, pinned: bool = False,
            ref_id: str | None = None, expires_in: float | None = None, connection: str = "",
            files: int = 0) -> RefEntry:
        """`files`: the open files the object took when it was made, counted against its maker's share."""
        key = (owner, session_id)
        payer, host = payer_of(owner, connection)
        owned = self._sessions.get(key)
        if owned is None:
            if len(self._sessions) >= self.max_sessions:
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id} holds {len(self._sessions):,} sessions, its limit "
                                  f"(max_sessions): release a session first", reason="max_sessions")
            share = self.max_sessions - self.max_sessions // 4
            if owner and self._session_tally.held(owner) >= share:   # identities: one may not take all
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id} holds {share:,} sessions of this client, the most one "
                                  f"client may hold (max_sessions {self.max_sessions:,}: the last quarter is kept "
                                  f"for other clients): release a session first", reason="max_sessions")
            why = "" if owner else self._session_tally.refusal(payer, host, 1, self.max_sessions, "sessions")
            if why:
                raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                                  f"worker {self.worker_id}: no new session {clip(session_id, 80)!r}: {why} "
                                  f"(max_sessions): release a session first", reason="max_sessions")
        why = self._count.refusal(payer, host, 1, self.max_refs_per_client, "refs")
        if why:
            self._press(host)
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                              f"worker {self.worker_id} holds no more refs for this caller: {why} "
                              f"(max_refs_per_client): release some first", reason="max_refs_per_client")
        # A session holds at most session_cap refs of each payer (one, with an identity): past it the
        # adder's own oldest there goes, never another client's.
        mine = self._in_session.get((key, payer))
        victim = next(iter(mine)) if mine is not None and len(mine) >= self.session_cap else None
        nbytes = 0
        if not pinned and id(obj) not in self._holders and self.max_ref_bytes_per_client:
            nbytes = held_bytes(obj, self._published)
            self._room_for_bytes(payer, host, nbytes, f"a ref to this {_type_name(obj)}")
        holder = _files_holder(owner, connection) if files > 0 else ""
        if files > 0:
            self._settle_files()
            if id(obj) in self._file_charges:
                files = 0           # charged already, to its maker, while it lives
            else:
                self._room_for_files(holder, files, f"a ref to this {_type_name(obj)}")
        if victim is not None:
            self._drop(victim, f"evicted: session {session_id!r} exceeded its cap of {self.session_cap} refs (of "
                               f"one client's)")
            owned = self._sessions.get(key)
        if nbytes:
            self._bytes.add(payer, host, nbytes)
            self._charged[id(obj)] = (payer, host, nbytes)
        entry = RefEntry(ref_id or f"{self.worker_id}.{secrets.token_urlsafe(18)}", obj, owner, session_id,
                         _type_name(obj), exclusive, pinned=pinned, connection="" if owner else connection,
                         payer=payer, host=host)
        if files > 0:
            self._charge_files(obj, holder, files)
        if expires_in and not pinned:
            entry.expires = entry.created + expires_in
        self._refs[entry.id] = entry
        self._holders[id(obj)] = self._holders.get(id(obj), 0) + 1
        if pinned:
            self._published.add(id(obj))
        self._count.add(payer, host, 1)
        if owned is None:
            owned = self._sessions[key] = OrderedDict()
            self._session_payer[key] = (payer, host)
            self._session_tally.add(payer, host, 1)
        owned[entry.id] = None
        self._in_session.setdefault((key, payer), OrderedDict())[entry.id] = None
        return entry

    def object_of(self, ref_id: str) -> object | None:
        """What a ref holds, if it is here; not a use of it."""
        entry = self._refs.get(ref_id)
        return None if entry is None else entry.obj

    def get(self, ref_id: str, owner: str | None = None) -> RefEntry:
        """The ref; a client (`owner` given) may use only its own identity's."""
        entry = self._refs.get(ref_id)
        if entry is None:
            raise self._gone_error(ref_id)
        if owner is not None and entry.owner != owner:
            raise self._foreign(ref_id)
        entry.last_used = time.monotonic()
        return entry

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
            mine = list(self._in_session.get(((owner, session_id), payer_of(owner, connection)[0])) or ())
            return sum(self._drop(r, f"released with its session {session_id!r}") for r in mine)
        gone: dict[str, None] | None = self._sessions.pop((owner, session_id), None)
        if gone is None:
            return 0
        self._session_gone((owner, session_id))
        return sum(self._drop(r, f"released with its session {session_id!r}") for r in list(gone))

    def _session_gone(self, key: tuple[str, str]) -> None:
        payer, host = self._session_payer.pop(key, ("", None))
        self._session_tally.add(payer, host, -1)

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

    def unused_since(self, cutoff: float) -> list[RefEntry]:
        """The refs no call has used since `cutoff` (time.monotonic()), published ones aside."""
        return [e for e in self._refs.values() if e.last_used < cutoff and not e.pinned]

    def evict(self, ref_id: str, reason: str) -> bool:
        """Drops a ref for the worker's own reason (its error says it to whoever presents it later)."""
        return self._drop(ref_id, reason)

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
                self._session_gone(key)
        self._count.add(entry.payer, entry.host, -1)
        theirs = self._in_session.get((key, entry.payer))
        if theirs is not None:
            theirs.pop(ref_id, None)
            if not theirs:
                del self._in_session[(key, entry.payer)]
        self._gone[ref_id] = reason
        while len(self._gone) > self._max_tombstones:
            self._gone.popitem(last=False)
        left = self._holders.pop(id(entry.obj)) - 1
        if left:
            self._holders[id(entry.obj)] = left
        else:
            self._published.discard(id(entry.obj))
            if id(entry.obj) in self._charged_until_released:
                self._charged_until_released.discard(id(entry.obj))
                self._files_freed.append(id(entry.obj))
            charged = self._charged.pop(id(entry.obj), None)
            if charged is not None:     # refs never pass between identities: whoever made its first pays
                payer, host, nbytes = charged
                self._bytes.add(payer, host, -nbytes)
            if self._finalize is not None:
                self._finalize(entry.obj)   # the last ref to this object is gone
        return True

    def tally(self, keep: Callable[[object], bool], adding: Mapping[tuple[str, str | None], int]) -> Tally:
        """The objects `keep` selects (engines, say), each counted once, against whoever made the first
        ref to it, and `adding`'s, by payer: for a limit of such objects with the same shares."""
        out, seen = Tally(), set()
        for e in self._refs.values():
            if id(e.obj) not in seen and keep(e.obj):
                seen.add(id(e.obj))
                out.add(e.payer, e.host, 1)
        for (payer, host), n in adding.items():
            out.add(payer, host, n)
        return out

    def holds(self, obj: object) -> bool:
        """Whether any ref holds `obj`."""
        return id(obj) in self._holders

    def room_to_set(self, obj: object, value: object, owner: str, connection: str) -> None:
        """Refuses setting `value` on an object refs hold where the bytes it brings would pass its
        payer's share of max_ref_bytes_per_client: bytes were counted only when a ref was made, so an
        attribute set afterwards (a small DPMetadata given a 48 MB tensor, 24 times) went uncounted."""
        if id(obj) not in self._holders or not self.max_ref_bytes_per_client:
            return
        nbytes = held_bytes(value, self._published)
        payer, host, _ = self._charged.get(id(obj), (*payer_of(owner, connection), 0))
        self._room_for_bytes(payer, host, nbytes, f"setting a {_type_name(value)} on this {_type_name(obj)}")

    def _press(self, host: str | None) -> None:
        if host is not None and len(self._pressed) < 1024:
            self._pressed.add(host)

    def pressed(self) -> set[str]:
        """The hosts refused for their share since the last time this was asked (and forgotten now):
        the worker's sweep takes back at once what their closed connections left (`reclaim.py`)."""
        hosts, self._pressed = self._pressed, set()
        return hosts

    def _room_for_bytes(self, payer: str, host: str | None, nbytes: int, what: str) -> None:
        why = self._bytes.refusal(payer, host, nbytes, self.max_ref_bytes_per_client, "bytes") if nbytes else ""
        if why:
            self._press(host)
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                              f"worker {self.worker_id}: {what} ({nbytes:,} bytes) would pass the bytes (tensors, "
                              f"text, containers) refs may hold: {why} (max_ref_bytes_per_client): release some first",
                              reason="max_ref_bytes_per_client")

    def _charge_files(self, obj: object, holder: str, files: int) -> None:
        self._file_charges[id(obj)] = (holder, files)
        self._files[holder] = self._files.get(holder, 0) + files
        try:
            weakref.finalize(obj, self._files_freed.append, id(obj))   # (append: safe from any thread)
        except TypeError:
            self._charged_until_released.add(id(obj))

    def _settle_files(self) -> None:
        """Takes back the charges of the objects collected since (their finalizers queued them)."""
        while self._files_freed:
            charge = self._file_charges.pop(self._files_freed.popleft(), None)
            if charge is not None:
                _bump(self._files, charge[0], -charge[1])

    def _room_for_files(self, holder: str, files: int, what: str) -> None:
        """`files` more for `holder` (already open: the object is made), within its share of what the
        worker's own files (its engines, connections, libraries) leave of the cap to clients' objects."""
        cap, now = self.files_cap(), self.files_open()
        if cap is None or now is None:
            return
        held, total = self._files.get(holder, 0), sum(self._files.values())
        room = cap - (now - files - total)
        share = math.ceil(SHARE * max(room - (total - held), 0))
        if held + files > share:
            raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "ref",
                              f"worker {self.worker_id}: {what} holds {files:,} open files, and this client's "
                              f"objects hold {held:,}: of the {max(room, 0):,} the worker's clients' objects may hold "
                              f"open together, a host (an identity) holds at most {SHARE:.0%} of what the others "
                              f"leave ({share:,} now): release refs first", reason="too many open files")

    def recount(self, obj: object, owner: str, connection: str) -> None:
        """After an object refs hold changed in place: its charge becomes what it holds now."""
        if id(obj) not in self._holders or not self.max_ref_bytes_per_client:
            return
        payer, host, before = self._charged.pop(id(obj), (*payer_of(owner, connection), 0))
        try:
            now = held_bytes(obj, self._published)
        except TooManyParts:         # (changed already: it keeps the charge it had)
            now = before
        self._bytes.add(payer, host, now - before)
        if now:
            self._charged[id(obj)] = (payer, host, now)

    def held_bytes(self, owner: str, connection: str = "") -> int:
        """Bytes charged to an identity's refs (without one, to a connection's)."""
        return self._bytes.held(payer_of(owner, connection)[0])

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
        worker, dot, token = ref_id.partition(".")
        if not (worker and dot and token):
            return RefGone(grpc.StatusCode.INVALID_ARGUMENT, "ref",
                           f"{quote(ref_id)} is not a ref id (a Ref's id: its worker's id, a dot and a token)",
                           reason="not a ref id", parameter=ref_id)
        if not ref_id.startswith(self.worker_id + "."):
            return RefGone(grpc.StatusCode.NOT_FOUND, "ref",
                           f"ref {ref_id} is not held by worker {self.worker_id} (a pool server sends a call to "
                           f"the worker of the refs its request carries and of those named in x-bridge-refs)",
                           reason="wrong worker",
                           parameter=ref_id)
        return RefGone(grpc.StatusCode.NOT_FOUND, "ref", f"ref {ref_id} is unknown to worker {self.worker_id}",
                       reason="unknown ref", parameter=ref_id)
