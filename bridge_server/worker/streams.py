"""How a worker produces a stream's items: iterating what a streaming call returned, within its
deadlines, and putting each item into the message that carries it, in the stream's encoding.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from bridge_server.wire.codec import Encoder
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.patch import Patcher
from bridge_server.wire.protocol import STREAM_PATCH_V1
from bridge_server.worker.deadlines import Deadlines, Watchdog
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["PutItem", "Tee", "item_writer", "iterate", "next_deadline"]

# Puts a stream item into the message that carries it (`StreamItem` or `MuxEvent`: both have `value`
# and `patch`).
PutItem = Callable[[Any, Any], None]


def item_writer(encoder: Callable[[bool], Encoder], encoding: str | None) -> PutItem:
    """How one stream's items go into their messages: whole Values (FULL), or patches against the
    item before (PATCH_V1, which the caller asked for). `encoder(stream)` makes the encoder: for a
    stream of whole values, one that remembers the fields that stay the same object."""
    if encoding == STREAM_PATCH_V1:
        return Patcher(encoder(False)).put
    whole = encoder(True)

    def put(item: Any, msg: Any) -> None:
        whole.encode_into(item, msg.value)
    return put


async def iterate(source: Any, label: str, deadlines: Deadlines, in_thread: Callable[[Callable[[], Any]], Awaitable[Any]],
                  interval_s: float | None = None) -> AsyncIterator[Any]:
    """The items of what a streaming call returned (an async generator, or an iterator stepped in a
    thread by `in_thread`), within the stream's deadlines, coalesced to one per `interval_s`."""
    if hasattr(source, "__anext__") or hasattr(source, "__aiter__"):
        agen = source.__aiter__()
        step: Callable[[], Any] = agen.__anext__
        done_exc: type[BaseException] = StopAsyncIteration
        close = getattr(agen, "aclose", None)
    elif hasattr(source, "__iter__") and not isinstance(source, (str, bytes, dict)):
        it = iter(source)
        sentinel = object()
        step = lambda: in_thread(lambda: next(it, sentinel))  # noqa: E731
        done_exc = StopIteration
        close = getattr(it, "close", None)
    else:
        raise BridgeError.validation(f"{label} returned {type(source).__qualname__}, which is not iterable: "
                                     f"use Call instead of Stream", target=label)
    first = True
    watchdog = Watchdog()
    try:
        while True:
            watchdog.arm(deadlines.call if first else next_deadline(deadlines))
            try:
                item = await step()
            except done_exc:
                return
            except asyncio.CancelledError:
                if watchdog.expired_cancel():
                    doing = "waiting for the first item" if first else "waiting for the next item"
                    raise BridgeError.timeout(f"{label}: deadline exceeded while {doing}",
                                              target=label) from None
                raise
            except Exception as exc:   # the called code failed: a python_error, mapped as for Call
                raise BridgeError.from_exception(exc, label) from exc
            finally:
                watchdog.disarm()
            if done_exc is StopIteration and item is sentinel:
                return
            first = False
            sent = time.monotonic()
            yield item
            if interval_s:
                # Coalescing: not asking for the next item yet lets vLLM merge the outputs that
                # arrive meanwhile into one (its per-request collector), so fewer messages carry
                # the same tokens. The first item is never held back.
                await asyncio.sleep(max(0.0, sent + interval_s - time.monotonic()))
    finally:
        watchdog.close()
        if close is not None:
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # closing is best effort: the stream's outcome is already decided
                pass


def next_deadline(deadlines: Deadlines) -> float | None:
    """When waiting for a stream's next item times out: the idle time from now, within the total."""
    idle, total = deadlines.stream_idle_s, deadlines.total
    if idle is None:
        return total
    at = time.monotonic() + idle
    return at if total is None or at < total else total


class Tee:
    """Both encodings of each item, taken at the same moment (the objects may change once the
    loop turns): the patch goes out first, the whole Value right after it. For checking a
    receiver's patch decoding against whole values, item for item (`x-bridge-stream-tee`)."""

    def __init__(self, patch: PutItem, whole: PutItem) -> None:
        self.patch, self.whole = patch, whole
        self.held = pb.StreamItem()

    def first(self, item: Any, msg: Any) -> None:
        self.held = pb.StreamItem()
        self.whole(item, self.held)
        self.patch(item, msg)

    def second(self, item: Any, msg: Any) -> None:
        msg.value.CopyFrom(self.held.value)
