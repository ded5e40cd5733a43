"""Costly work takes turns on a server's event loop: a worker's large results and requests, and
the pool server's large Multiplex messages.

Why: a server does its work on one event loop, and what a result costs is not what its request
costs. A 100-byte request can ask for a 9 MB attribute, ~60 ms of encoding; sixty of them held a
worker's loop for seconds, and every other call and token stream of the worker, anyone's, waited
behind them. A stream's items are already paced (`worker/streams.py`, `Pace`); this does the same for results
and for large requests.

A result whose encoding goes past the encoder's `work_limit` stops and waits for a turn. One such
result is encoded at a time, and after it the next turn waits `REST_FACTOR` times as long as that
encoding took, so costly results get at most a quarter of the loop, and the loop serves everything
else in between. Turns go round the hosts that wait, and within a host round its callers (their
identity, else their connection, as the pool server names it; never a session, which a caller
names as it likes): one caller's queue of large results does not hold back another's, and a
stranger's many connections from one host get one host's turns.
A caller's deadline bounds its wait. Results under the bound never wait: nearly every call. A turn
is bounded too: a result past MAX_RESULT_WORK is refused (RESOURCE_EXHAUSTED, "result too large"),
as a request past max_prompt_chars items is, or one turn could hold the loop for as long as it takes
(3 million tensor views held it 26 s). Results of TURN_RESULT_BYTES or more are sent in turns,
however little they cost to encode: text, bytes and tensors are copied whole, but every byte is
copied again on its way out (sixty 16 MB results of text held the loop 9 s).

Requests of LARGE_REQUEST_BYTES or more (`wire/protocol.py`) are parsed and decoded in turns too:
decoding a value costs what encoding it does, and protobuf's parse of a message of many tiny values
more, in one call nothing can cut short (57 MiB of empty values: 1.6 s of the loop and 1.5 GB). A
worker parses such a call in its caller's turn, and a Multiplex message of that size in its
connection's; the pool server, which never decodes a value, parses only its Multiplex messages
whole (their calls stay bytes), and a large one in its connection's turn.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Callable
from typing import TypeVar

from bridge_server.wire.errors import BridgeError
from bridge_server.wire.protocol import LARGE_REQUEST_BYTES, host_of

T = TypeVar("T")

__all__ = ["MAX_RESULT_WORK", "MAX_TURN_S", "REST_FACTOR", "SEND_S_PER_BYTE", "TURN_RESULT_BYTES",
           "WORK_LIMIT", "WORK_TIME_S", "Round", "Turns", "join_round", "next_in_round", "read_in_turn"]

WORK_LIMIT = 8192       # items encoded inline at most (~1-3 ms of the loop); past it, a result waits its turn
WORK_TIME_S = 0.005     # ... or time: an item's cost varies (a tensor view costs 30 times an int)
MAX_RESULT_WORK = 1 << 20   # items one turn encodes at most (0.3-0.8 s): a larger result is refused, not sent
MAX_TURN_S = 1.0            # ... or time
TURN_RESULT_BYTES = 1 << 20      # a result this large is sent in its turn, however cheap it was to encode
SEND_S_PER_BYTE = 2e-9           # what sending a result's byte costs the loop (copies), as a turn counts it
REST_FACTOR = 3.0       # after a turn, the loop is left to everything else for this many times its length


W = TypeVar("W")
# Who waits for a turn: host -> caller -> its waits, in the order of the round at both levels.
Round = dict[str, dict[str, collections.deque[W]]]


def join_round(waiting: Round[W], caller: str, waiter: W) -> None:
    waiting.setdefault(host_of(caller), {}).setdefault(caller, collections.deque()).append(waiter)


def next_in_round(waiting: Round[W]) -> W:
    """The next wait: the first caller's of the first host, both then at the round's end (there
    must be one)."""
    host = next(iter(waiting))
    callers = waiting.pop(host)
    caller = next(iter(callers))
    queue = callers.pop(caller)
    waiter = queue.popleft()
    if queue:
        callers[caller] = queue
    if callers:
        waiting[host] = callers
    return waiter


class Turns:
    """The turns of one event loop's costly results."""

    def __init__(self, rest_factor: float = REST_FACTOR) -> None:
        self.rest_factor = rest_factor
        # host -> caller -> its waits; dict order is the order of the round, at both levels
        self._waiting: Round[asyncio.Future[None]] = {}
        self._busy = False
        self._free_at = 0.0             # time.monotonic() from when the next turn may begin
        self._timer: asyncio.TimerHandle | None = None
        self._started = 0.0             # when the turn being taken began

    def waiting(self) -> int:
        return sum(len(q) for callers in self._waiting.values() for q in callers.values())

    async def acquire(self, caller: str) -> None:
        """Waits for `caller`'s turn. The turn lasts until `release`, and its length sets the rest after it."""
        if not self._busy and not self._waiting and time.monotonic() >= self._free_at:
            self._take()
            return
        waiter = asyncio.get_running_loop().create_future()
        join_round(self._waiting, caller, waiter)
        self._schedule()
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():     # given the turn, then cancelled: pass it on
                self._busy = False
                self._schedule()
            else:
                host = host_of(caller)
                callers = self._waiting.get(host, {})
                queue = callers.get(caller)
                if queue is not None and waiter in queue:
                    queue.remove(waiter)
                    if not queue:
                        del callers[caller]
                        if not callers:
                            del self._waiting[host]
            raise
        self._started = time.monotonic()

    def release(self, at_least_s: float = 0.0) -> None:
        """Ends the turn, which counts as lasting `at_least_s` if it was shorter (work it set going
        that comes after it: sending a result's bytes)."""
        now = time.monotonic()
        self._busy = False
        self._free_at = now + max(now - self._started, at_least_s) * self.rest_factor
        self._schedule()

    def _take(self) -> None:
        self._busy = True
        self._started = time.monotonic()

    def _schedule(self) -> None:
        if self._busy or not self._waiting or self._timer is not None:
            return
        delay = self._free_at - time.monotonic()
        if delay > 0:
            self._timer = asyncio.get_running_loop().call_later(delay, self._give)
        else:
            self._give()

    def _give(self) -> None:
        """The next turn, to the first caller of the first host in the round (both then go to the
        round's end)."""
        self._timer = None
        if self._busy:
            return
        if time.monotonic() < self._free_at:
            self._schedule()
            return
        while self._waiting:
            waiter = next_in_round(self._waiting)
            if not waiter.done():
                self._busy = True
                waiter.set_result(None)
                return


async def read_in_turn(turns: Turns, caller: str, size: int, read: Callable[[], T], label: str,
                       timeout_s: float | None = None) -> T:
    """`read()` (a request's parse), in the caller's turn when the request is LARGE_REQUEST_BYTES or
    more: one such parse holds the loop at a time, and the next waits REST_FACTOR times as long.
    The wait is bounded by the call's time left."""
    if size < LARGE_REQUEST_BYTES:
        return read()
    try:
        await asyncio.wait_for(turns.acquire(caller), timeout_s)
    except TimeoutError:
        raise BridgeError.timeout(f"{label}: deadline exceeded waiting for its turn to read a large request",
                                  target=label) from None
    try:
        return read()
    finally:
        turns.release()
