"""Ending streams whose caller stops reading.

A stream holds a worker slot until it ends, and nothing but its caller's reading makes it go on once
its window is full: a caller that stops reading (a stranger's trick, or a bug) would hold the slot
for as long as its connection lives, and enough such streams hold every slot while health says
SERVING. So each wait for the caller (a write gRPC's flow control holds back, or a wait for the
caller's credit) is bounded by the pool's `reader_stall_s`; past it the stream ends with
DEADLINE_EXCEEDED (reason "reader stalled") and frees its slot.

Per-token cost matters here (a wait happens for every item), so a wait is not given a timer of its
own: it notes when it started, and one sweeper per event loop looks over the waits now and then,
cancelling those past their bound. A wait that ends in time costs two dict operations.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

import grpc

from bridge_server.wire.errors import BridgeError

__all__ = ["CONTENDED_STALL_S", "READER_STALL_S", "StallGuard", "Waiting", "contended_stall", "reader_stalled"]

READER_STALL_S = 60.0      # the default bound on a caller that reads nothing while items wait
CONTENDED_STALL_S = 5.0    # the same while other calls wait for the slot (the pool's queue; poolstate.py)

T = TypeVar("T")


class Waiting(Protocol):
    """What notes since when a wait on the caller has lasted (0.0: none lasts)."""

    waiting: float


def reader_stalled(label: str, stall_s: float) -> BridgeError:
    return BridgeError(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout",
                       f"{label}: the caller read nothing for {stall_s:g} s while items waited for it "
                       f"(reader_stall_s); the stream was ended to free its worker slot",
                       target=label, reason="reader stalled")


def contended_stall(pool: str, stall_s: float) -> BridgeError:
    return BridgeError(grpc.StatusCode.DEADLINE_EXCEEDED, "timeout",
                       f"the caller read none of this stream's items for {stall_s:g} s while other calls "
                       f"waited for a worker slot in pool {pool!r} (contended_stall_s); the stream was ended "
                       f"to free its slot", reason="reader stalled")


class StallGuard:
    """The bounded waits of one event loop's streams. `stall_s` None or 0: unbounded."""

    def __init__(self, stall_s: float | None = READER_STALL_S) -> None:
        self.stall_s = stall_s or None
        self._waiting: dict[asyncio.Task[object], float] = {}   # task -> until when it may wait
        self._stalled: set[asyncio.Task[object]] = set()
        self._sweeper: asyncio.Task[None] | None = None
        self._period = 1.0

    async def wait(self, aw: Awaitable[T], label: str, stall_s: float | None = None,
                   mark: Waiting | None = None) -> T:
        """`aw` (a wait on the caller), ended with `reader_stalled` once it has taken `stall_s`
        (this guard's own bound when None; 0: unbounded). `mark.waiting` says since when it waits
        (0.0 once it is over), for whoever ends stalled streams sooner (the pool, while calls queue)."""
        bound = self.stall_s if stall_s is None else (stall_s or None)
        task = asyncio.current_task()
        if mark is None and (bound is None or task is None):
            return await aw
        now = time.monotonic()
        if mark is not None:
            mark.waiting = now
        if bound is not None and task is not None:
            self._waiting[task] = now + bound
            if self._sweeper is None or bound < self._period * 4:
                self._start(bound)
        try:
            return await aw
        except asyncio.CancelledError:
            if task is not None and task in self._stalled:
                self._stalled.discard(task)
                if task.uncancel() == 0:
                    raise reader_stalled(label, bound or 0.0) from None
            raise
        finally:
            if task is not None:
                self._waiting.pop(task, None)
            if mark is not None:
                mark.waiting = 0.0

    def _start(self, bound: float) -> None:
        """(Re)starts the sweeper, often enough to end a wait within a quarter of its bound late."""
        self._period = min(1.0, bound / 4)
        if self._sweeper is None:
            self._sweeper = asyncio.get_running_loop().create_task(self._sweep())

    async def _sweep(self) -> None:
        try:
            while True:
                await asyncio.sleep(self._period)
                if not self._waiting:
                    return          # started again by the next wait
                now = time.monotonic()
                for task, until in list(self._waiting.items()):
                    if until <= now and task not in self._stalled:
                        self._stalled.add(task)
                        task.cancel()
        finally:
            self._sweeper = None

    def close(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
