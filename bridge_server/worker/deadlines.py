"""A call's deadlines, as the worker enforces them.

The worker, not the client, keeps deadlines: async work is cancelled for real (AsyncLLM aborts the
request), and a stream is bounded item by item. The explicit deadline (gRPC's, else
x-bridge-timeout-ms) beats the call's timeout profile, which beats the target's default profile.

A stream's deadline moves with every item (the idle timeout restarts), and `asyncio.timeout` per item
costs a context object, a timer handle and a heap entry each time: ~6 us, once per token. So a stream
has one `Watchdog`: moving its deadline is a store; the single timer, when it fires before the current
deadline, re-arms itself for it, and only when the deadline has really passed does it cancel the
waiting task, the way `asyncio.timeout` would. A deadline earlier than the pending timer (a stream's
first item may wait longer than the idle time allowed between items) replaces the timer.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

from bridge_server.wire.errors import BridgeError
from bridge_server.wire.options import PROFILES, RuntimeOptions, explicit_timeout


@dataclass(frozen=True)
class Deadlines:
    """Absolute monotonic deadlines for one call (None: unlimited)."""

    call: float | None          # the whole call (unary) / the wait for the first item (stream)
    total: float | None         # hard cap from the caller's explicit deadline, for streams
    stream_idle_s: float | None

    def remaining(self, at: float | None) -> float | None:
        return None if at is None else max(0.0, at - time.monotonic())


def resolve_deadlines(opts: RuntimeOptions, grpc_remaining_s: float | None, target_profile: str) -> Deadlines:
    """The explicit deadline (`explicit_timeout`) beats the call's profile, which beats the target's
    default profile."""
    now = time.monotonic()
    profile = PROFILES[opts.timeout_profile or target_profile]
    explicit = explicit_timeout(opts, grpc_remaining_s)
    idle = opts.stream_timeout_s if opts.stream_timeout_s is not None else profile.stream_idle_s
    if explicit is not None:
        return Deadlines(call=now + explicit, total=now + explicit, stream_idle_s=idle)
    call = None if profile.call_s is None else now + profile.call_s
    return Deadlines(call=call, total=None, stream_idle_s=idle)


async def with_deadline(aw: Any, at: float | None, label: str, doing: str = "running") -> Any:
    """Awaits within a deadline (monotonic `at`), failing with the bridge's own timeout error that
    names `label`. asyncio.timeout, not wait_for: no extra task per await, which matters once per
    streamed item."""
    if at is None:
        return await aw
    timeout = asyncio.timeout_at(asyncio.get_running_loop().time() + (at - time.monotonic()))
    try:
        async with timeout:
            return await aw
    except TimeoutError:
        if not timeout.expired():
            raise       # the called function's own (vLLM's drain with a timeout of 0), not the call's deadline
        raise BridgeError.timeout(f"{label}: deadline exceeded while {doing}", target=label) from None


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
