"""What the pool server holds for callers that have not read it, and one bound on all of it (large
requests it holds until their calls end count in it too: `take(..., request=True)`).

Why: a reply waits in the pool server until its caller reads it. gRPC keeps a reply whose caller
does not read (a unary one, or a stream's message in a write that flow control holds back) until the
caller reads it, resets the call, or its connection closes: nothing on the server's side frees it.
Each stream bounds what it queues (a Multiplex stream MAX_UNWRITTEN_BYTES), but a caller may start
any number of calls and streams, over any number of connections, and a pool server out of memory
fails every caller at once. So replies' bytes count in one `Backlog` from the moment they arrive
until they are really gone (a Multiplex stream's all; a Call's and a Stream item's from 64 KiB up, as
smaller ones are one per call at most), and `max_unread_bytes` bounds them:

- A result is taken only if it fits: within the limit, or, past it, within its caller's share and
  within twice the limit. One that does not fit ends its call with RESOURCE_EXHAUSTED (reason
  "unread replies"): the bound holds however many connections a stranger opens, and past the limit
  each caller still gets its share.
- Shares are taken in two steps, so that more connections buy no more of the server: the limit is
  shared between the hosts holding anything (or identities, where the server authenticates), and a
  host's share between its connections. A host's connections together may pass its share by half
  (HOST_SLACK), so that a connection beside one that hoards on the same host still gets its own
  share. A stranger's many connections from one host then hold at most 1.5 host shares past the
  limit, and a caller on another host always has room within twice the limit.
- Past the limit, a caller holding more than its share gets no new call until it reads.
- Streams that are not being read (a write blocked for BLOCKED_S) are ended, those of the caller
  holding the most first, which frees what they queued; a stream whose writes go out is never
  ended for what it queues.

Callers are told apart as the router's queue knows them: their identity where the server
authenticates, else their connection (its peer address, `ipv4:HOST:PORT`, from which the host is
read). A caller's many calls and streams count together.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError
from bridge_server.wire.protocol import host_of

__all__ = ["BLOCKED_S", "DEFAULT_MAX_UNREAD_BYTES", "HOST_SLACK", "Backlog", "Holding"]

log = logging.getLogger("vllm_bridge.router")

DEFAULT_MAX_UNREAD_BYTES = 1 << 30
BLOCKED_S = 0.5     # a stream whose write has waited this long for its caller is not being read
HOST_SLACK = 1.5    # what a host's connections may hold together past the limit, in host shares


@dataclass(eq=False)
class Holding:
    """What one call or stream holds: `held` bytes, of which `pending` are in writes gRPC has not
    finished (freed only when the caller reads them or goes). `end` ends a stream (once, with the
    reason); None for what cannot be ended (a unary reply gRPC already has)."""

    caller: str
    label: str
    end: Callable[[BridgeError], None] | None = None
    held: int = 0
    pending: int = 0
    blocked_since: float = 0.0  # when its oldest unfinished write started
    ended: bool = False        # its queue is gone: only its pending writes still count
    closed: bool = False


@dataclass(eq=False)
class Backlog:
    """The bytes held for callers' unread replies, by caller, with a bound on their sum (0: none)."""

    limit: int = DEFAULT_MAX_UNREAD_BYTES
    total: int = 0
    by_caller: dict[str, int] = field(default_factory=dict)
    by_host: dict[str, int] = field(default_factory=dict)         # the same, summed by host
    callers_of: dict[str, int] = field(default_factory=dict)      # a host's callers holding anything
    holdings: dict[str, set[Holding]] = field(default_factory=dict)
    writing_streams: set[Holding] = field(default_factory=set)   # streams with a write in flight
    ended: int = 0            # streams ended for their caller's backlog, since the start
    refused: int = 0          # calls and results refused for it
    _recheck: asyncio.TimerHandle | None = field(default=None, repr=False)

    def over(self) -> bool:
        return 0 < self.limit < self.total

    # ---------------------------------------------------------------------------- what callers get
    def admit(self, caller: str, label: str) -> None:
        """Refuses a new call of a caller that holds more than its share while the bound is passed:
        a reply crossing the network is far less."""
        if not 0 < self.limit < self.total:
            return
        held = self.by_caller.get(caller, 0)
        if held > self._share(caller):
            self.refused += 1
            raise BridgeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "pool",
                f"{label}: the pool server holds {self.total:,} bytes of replies that their callers have not read, "
                f"over its max_unread_bytes ({self.limit:,}), and {held:,} of them are this caller's: it gets "
                f"no new call until it reads them", reason="unread replies")

    def take(self, h: Holding, n: int, label: str, request: bool = False) -> BridgeError | None:
        """Counts a result of n bytes that has arrived for the caller (queued until written); or,
        if it does not fit (see the module's doc), counts nothing and returns the RESOURCE_EXHAUSTED
        that ends its call. Returned, not raised: the caller drops the result before raising, so no
        traceback keeps megabytes alive until the cycle collector comes. `request`: n bytes of a large
        request the pool server holds until its call ends (gRPC has read it whole; it waits for a
        slot, and for its turn in the worker's lane), under the same bound as the same memory:
        ninety-six 60 MiB calls at once took the pool server to 8.4 GB."""
        if 0 < self.limit < self.total + n and not self._fits(h.caller, n):
            self.refused += 1
            held = self.by_caller.get(h.caller, 0)
            if request:
                return BridgeError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED, "pool",
                    f"{label}: its request of {n:,} bytes does not fit: the pool server holds {self.total:,} bytes "
                    f"for callers (large requests on their way to a worker, replies not yet read; max_unread_bytes "
                    f"{self.limit:,}), {held:,} of them this caller's: send fewer large calls at once",
                    reason="large requests")
            return BridgeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "pool",
                f"{label}: its result of {n:,} bytes does not fit: the pool server holds {self.total:,} bytes of "
                f"replies that their callers have not read (max_unread_bytes {self.limit:,}), {held:,} of them "
                f"this caller's; read them, or start fewer calls at once", reason="unread replies")
        self.add(h, n)
        return None

    def _fits(self, caller: str, n: int) -> bool:
        self._shed(n)              # what unread streams queue goes first
        if self.total + n <= self.limit:
            return True
        host = host_of(caller)
        return (self.total + n <= 2 * self.limit
                and self.by_host.get(host, 0) + n <= HOST_SLACK * self._host_share(host)
                and self.by_caller.get(caller, 0) + n <= self._share(caller))

    def _host_share(self, host: str) -> int:
        """The limit over the hosts holding anything, this one among them."""
        return self.limit // (len(self.by_host) + (host not in self.by_host))

    def _share(self, caller: str) -> int:
        """The caller's host's share over that host's callers holding anything, this one among them."""
        host = host_of(caller)
        return self._host_share(host) // (self.callers_of.get(host, 0) + (caller not in self.by_caller))

    # ---------------------------------------------------------------------------- the accounts
    def open(self, caller: str, label: str, end: Callable[[BridgeError], None] | None = None) -> Holding:
        h = Holding(caller, label, end)
        self.holdings.setdefault(caller, set()).add(h)
        return h

    def add(self, h: Holding, n: int) -> None:
        """n more bytes queued for the caller (ignored once the stream was ended: they are dropped)."""
        if h.ended or n <= 0:
            return
        h.held += n
        self._count(h.caller, n)

    def writing(self, h: Holding, n: int) -> None:
        """A write of n of its counted bytes starts: gRPC holds them until it ends."""
        if h.ended or n <= 0:
            return
        if not h.pending:
            h.blocked_since = time.monotonic()
            if h.end is not None:
                self.writing_streams.add(h)
        h.pending += n
        if 0 < self.limit < self.total:
            self._again()          # if the caller leaves it unread, its stream may be ended

    def written(self, h: Holding, n: int) -> None:
        """The write of n bytes ended: they are no longer held."""
        if h.closed:
            return
        n = min(n, h.pending)
        h.pending -= n
        h.held -= n
        self._count(h.caller, -n)
        if not h.pending:
            self.writing_streams.discard(h)

    def unwind(self, h: Holding) -> None:
        """The stream's handler ended: what it queued is freed, its writes in flight are not yet
        (`close` frees them, when the RPC ends)."""
        if not h.ended:
            self._end(h)
        if not h.held:
            self.close(h)

    def close(self, h: Holding) -> None:
        """The RPC ended (its status went out, or its caller went): nothing of it is held."""
        if h.closed:
            return
        h.closed = h.ended = True
        self.writing_streams.discard(h)
        self._count(h.caller, -h.held)
        h.held = h.pending = 0
        streams = self.holdings.get(h.caller)
        if streams is not None:
            streams.discard(h)
            if not streams:
                del self.holdings[h.caller]

    # ---------------------------------------------------------------------------------- inside
    def _count(self, caller: str, n: int) -> None:
        if not n:
            return
        self.total += n
        host = host_of(caller)
        was = self.by_caller.get(caller, 0)
        left = was + n
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)
        if (left > 0) != (was > 0):
            callers = self.callers_of.get(host, 0) + (1 if left > 0 else -1)
            if callers > 0:
                self.callers_of[host] = callers
            else:
                self.callers_of.pop(host, None)
        on_host = self.by_host.get(host, 0) + n
        if on_host > 0:
            self.by_host[host] = on_host
        else:
            self.by_host.pop(host, None)

    def _end(self, h: Holding) -> None:
        h.ended = True
        self.writing_streams.discard(h)
        queued = h.held - h.pending
        h.held = h.pending
        self._count(h.caller, -queued)

    def _again(self) -> None:
        """Over the bound: looks for unread streams again once a write may have waited BLOCKED_S
        (no new result need come for a stream that never reads to be ended)."""
        if self._recheck is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._recheck = loop.call_later(BLOCKED_S, self._look_again)

    def _look_again(self) -> None:
        self._recheck = None
        if 0 < self.limit < self.total:
            self._shed()
            if 0 < self.limit < self.total and self.writing_streams:
                self._again()

    def _shed(self, room: int = 0) -> None:
        """Ends the streams that are not being read (a write blocked for BLOCKED_S or more), those
        of the caller holding the most first, until the sum (and `room` more) is within the limit.
        Ending one frees what it queued; what gRPC holds in its write stays until its caller reads
        or goes."""
        while 0 < self.limit < self.total + room:
            now = time.monotonic()
            unread: dict[str, list[Holding]] = {}
            for h in self.writing_streams:
                if now - h.blocked_since >= BLOCKED_S:
                    unread.setdefault(h.caller, []).append(h)
            if not unread:
                return
            caller = max(unread, key=lambda who: self.by_caller.get(who, 0))
            streams = unread[caller]
            held = self.by_caller.get(caller, 0)
            log.warning("unread replies: %s bytes held in all (max_unread_bytes %s); ending the %d unread streams "
                        "of the caller holding the most (%s bytes): %s", self.total, self.limit, len(streams),
                        held, caller)
            message = (f"the pool server holds {self.total:,} bytes of replies that their callers have not read, "
                       f"over its max_unread_bytes ({self.limit:,}); this caller held the most ({held:,} bytes), "
                       f"and its streams left unread for {BLOCKED_S:g} s or more ({len(streams)}) were ended to "
                       f"free them")
            for h in streams:
                self._end(h)
                self.ended += 1
                assert h.end is not None
                h.end(BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool", f"{h.label}: {message}",
                                  reason="unread replies"))
