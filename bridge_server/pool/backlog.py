"""What the pool server holds for callers that have not read it, and one bound on all of it.

Why: a reply waits in the pool server until its caller reads it. gRPC keeps a reply whose caller
does not read (a unary one, or a stream's message in a write that flow control holds back) until the
caller reads it, resets the call, or its connection closes: nothing on the server's side frees it.
Each stream bounds what it queues (a Multiplex stream MAX_UNWRITTEN_BYTES), but a caller may start
any number of calls and streams, over any number of connections, and a pool server out of memory
fails every caller at once. So every reply's bytes count in one `Backlog` until they are really
gone, and past its limit (`max_unread_bytes`):

- a caller that has unread replies of its own gets no new call (RESOURCE_EXHAUSTED, reason "unread
  replies") until it reads them; callers with none go on. A caller that reads holds next to nothing,
  and then only for the time a reply takes to cross the network.
- the streams of the caller whose queued replies are the largest are ended, which frees what they
  queued (what gRPC already holds in a write is freed when the caller reads or goes).

Callers are told apart as the router's queue knows them: their identity where the server
authenticates, else their connection. A caller's many calls and streams count together.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from bridge_server.wire.errors import BridgeError

__all__ = ["DEFAULT_MAX_UNREAD_BYTES", "Backlog", "Holding"]

log = logging.getLogger("vllm_bridge.router")

DEFAULT_MAX_UNREAD_BYTES = 1 << 30


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
    ended: bool = False        # its queue is gone: only its pending writes still count
    closed: bool = False


@dataclass(eq=False)
class Backlog:
    """The bytes held for callers' unread replies, by caller, with a bound on their sum (0: none)."""

    limit: int = DEFAULT_MAX_UNREAD_BYTES
    total: int = 0
    by_caller: dict[str, int] = field(default_factory=dict)
    holdings: dict[str, set[Holding]] = field(default_factory=dict)
    ended: int = 0            # streams ended for their caller's backlog, since the start
    refused: int = 0          # calls refused for it

    def over(self) -> bool:
        return 0 < self.limit < self.total

    def admit(self, caller: str, label: str) -> None:
        """Refuses a new call of a caller that holds more than its share (the limit over the callers
        holding anything) while the bound is passed: a reply crossing the network is far less."""
        if not 0 < self.limit < self.total:
            return
        held = self.by_caller.get(caller, 0)
        if held > self.limit // len(self.by_caller):
            self.refused += 1
            raise BridgeError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "pool",
                f"{label}: the pool server holds {self.total:,} bytes of replies that their callers have not read, "
                f"over its max_unread_bytes ({self.limit:,}), and {held:,} of them are this caller's: it gets "
                f"no new call until it reads them", reason="unread replies")

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
        if 0 < self.limit < self.total:
            self._shed()

    def writing(self, h: Holding, n: int, queued: bool = True) -> None:
        """A write of n bytes starts: gRPC holds them until it ends. `queued`: they were counted
        already (`add`); else they count from now (a unary reply, a Stream's item)."""
        if h.closed or (queued and h.ended):
            return
        if not queued:
            h.held += n
            self._count(h.caller, n)
        h.pending += n
        if not queued and 0 < self.limit < self.total:
            self._shed()

    def written(self, h: Holding, n: int) -> None:
        """The write of n bytes ended: they are no longer held."""
        if h.closed:
            return
        n = min(n, h.pending)
        h.pending -= n
        h.held -= n
        self._count(h.caller, -n)

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
        self._count(h.caller, -h.held)
        h.held = h.pending = 0
        streams = self.holdings.get(h.caller)
        if streams is not None:
            streams.discard(h)
            if not streams:
                del self.holdings[h.caller]

    # ---------------------------------------------------------------------------------- inside
    def _count(self, caller: str, n: int) -> None:
        self.total += n
        left = self.by_caller.get(caller, 0) + n
        if left > 0:
            self.by_caller[caller] = left
        else:
            self.by_caller.pop(caller, None)

    def _end(self, h: Holding) -> None:
        h.ended = True
        queued = h.held - h.pending
        h.held = h.pending
        self._count(h.caller, -queued)

    def _shed(self) -> None:
        """Ends the streams of the caller that holds the most, and so frees what they queued. What
        gRPC holds in writes cannot be freed from here: when that is all the caller holds, nothing
        is ended (a caller holding less is never ended for it)."""
        while 0 < self.limit < self.total:
            caller = max(self.by_caller, key=self.by_caller.__getitem__)
            streams = [h for h in self.holdings.get(caller, ()) if not h.ended and h.end is not None]
            queued = sum(h.held - h.pending for h in streams)
            if not queued:
                return
            held = self.by_caller[caller]
            log.warning("unread replies: %s bytes held in all (max_unread_bytes %s); ending the %d streams of "
                        "the caller holding the most (%s bytes, %s queued): %s", self.total, self.limit,
                        len(streams), held, queued, caller)
            message = (f"the pool server holds {self.total:,} bytes of replies that their callers have not read, "
                       f"over its max_unread_bytes ({self.limit:,}); this caller held the most ({held:,} bytes, "
                       f"{len(streams)} streams) and its streams were ended to free them")
            for h in streams:
                self._end(h)
                self.ended += 1
                assert h.end is not None
                h.end(BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "pool", f"{h.label}: {message}",
                                  reason="unread replies"))
