"""The stream deadline timer: one timer per stream, deadlines that move both ways."""

from __future__ import annotations

import asyncio
import time

import pytest

from bridge_server.wire.errors import BridgeError
from bridge_server.worker.deadlines import Watchdog, with_deadline


async def _items(gaps: list[float]) -> list[int]:
    """Waits out each gap under a 0.5 s deadline re-armed per item; returns how many it got."""
    w = Watchdog()
    got = []
    try:
        for i, gap in enumerate(gaps):
            w.arm(time.monotonic() + 0.5)
            try:
                await asyncio.sleep(gap)
            except asyncio.CancelledError:
                assert w.expired_cancel()
                return got
            finally:
                w.disarm()
            got.append(i)
        return got
    finally:
        w.close()


def test_a_deadline_moved_on_each_item_fires_only_after_a_gap_longer_than_it() -> None:
    # 20 gaps add up to more than the deadline: only a single gap longer than it fires.
    assert asyncio.run(_items([0.05] * 20 + [2.0, 0.01])) == list(range(20))
    assert asyncio.run(_items([0.05] * 12)) == list(range(12))


def test_an_earlier_deadline_replaces_a_later_pending_timer() -> None:
    async def run() -> float:
        w = Watchdog()
        w.arm(time.monotonic() + 60)       # e.g. the first item's call timeout
        w.disarm()
        w.arm(time.monotonic() + 0.2)      # then the idle timeout between items
        t0 = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.sleep(5)
        assert w.expired_cancel() and asyncio.current_task().cancelling() == 0  # type: ignore[union-attr]
        return time.monotonic() - t0
    assert asyncio.run(run()) < 4.0


def test_a_cancel_that_is_not_the_deadline_stays_a_cancel() -> None:
    async def run() -> bool:
        w = Watchdog()
        w.arm(time.monotonic() + 60)
        task = asyncio.current_task()
        assert task is not None
        asyncio.get_running_loop().call_later(0.01, task.cancel)
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            return w.expired_cancel()
        finally:
            w.close()
        return True
    assert asyncio.run(run()) is False


def test_a_functions_own_timeout_is_not_told_as_the_calls_deadline() -> None:
    """vLLM's drain raised its own TimeoutError for a drain timeout of 0, and the call's far deadline
    was said to have passed ("deadline exceeded while running") within 10 ms."""
    async def own() -> None:
        raise TimeoutError("Timeout reached after 0 seconds waiting for requests to drain.")

    async def main() -> None:
        with pytest.raises(TimeoutError, match="waiting for requests to drain"):
            await with_deadline(own(), time.monotonic() + 60, "drain")
        with pytest.raises(BridgeError, match="drain: deadline exceeded while running"):
            await with_deadline(asyncio.sleep(5), time.monotonic() + 0.05, "drain")
    asyncio.run(main())
