"""One deadline timer for a whole stream.

A stream's deadline moves with every item (the idle timeout restarts), and `asyncio.timeout` per item
costs a context object, a timer handle and a heap entry each time: ~6 us, once per token. Here moving
the deadline is a store; the single timer, when it fires before the current deadline, re-arms itself
for it, and only when the deadline has really passed does it cancel the waiting task, the way
`asyncio.timeout` would. A deadline earlier than the pending timer (a stream's first item may wait
longer than the idle time allowed between items) replaces the timer.
"""

from __future__ import annotations

import asyncio
import time


class Watchdog:
    """Cancels `task` if it is still waiting (armed) when the armed deadline passes."""

    def __init__(self, task: asyncio.Task[object] | None = None) -> None:
        self._task = task or asyncio.current_task()
        self._loop = asyncio.get_running_loop()
        self._at: float | None = None          # time.monotonic() deadline while armed
        self._handle: asyncio.TimerHandle | None = None
        self._handle_at = 0.0                    # when the pending timer fires
        self.expired = False

    def arm(self, at: float | None) -> None:
        """Until disarm(), the task is cancelled at `at` (None: no deadline)."""
        self._at = at
        if at is None:
            return
        if self._handle is not None:
            if self._handle_at <= at:
                return
            self._handle.cancel()
        self._schedule(at)

    def disarm(self) -> None:
        self._at = None   # the timer, if any, finds nothing to do when it fires

    def close(self) -> None:
        self._at = None
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def expired_cancel(self) -> bool:
        """Called on CancelledError: True if the deadline caused it (it is then undone, so the caller
        can raise a timeout instead, as asyncio.timeout does)."""
        if not self.expired:
            return False
        self.expired = False
        if self._task is not None:
            self._task.uncancel()
        return True

    def _schedule(self, at: float) -> None:
        self._handle_at = at
        self._handle = self._loop.call_at(self._loop.time() + (at - time.monotonic()), self._fire)

    def _fire(self) -> None:
        self._handle = None
        at = self._at
        if at is None:
            return
        if time.monotonic() < at:
            self._schedule(at)
            return
        self.expired = True
        if self._task is not None:
            self._task.cancel()
