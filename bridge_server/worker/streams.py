"""How a worker produces a stream's items: iterating what a streaming call returned, within its
deadlines, and putting each item into the message that carries it, in the stream's encoding.
"""

from __future__ import annotations

import asyncio
import inspect
import sys
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from bridge_server.wire.codec import Encoder
from bridge_server.wire.errors import BridgeError
from bridge_server.wire.options import STREAM_PATCH_V1, STREAM_PATCH_V2
from bridge_server.wire.patch import Patcher
from bridge_server.wire.turns import SEND_S_PER_BYTE
from bridge_server.worker.deadlines import Deadlines, Watchdog
from vllm_bridge.v1 import bridge_pb2 as pb

__all__ = ["PACE_FACTOR", "PACE_MIN_S", "Pace", "PutItem", "Tee", "item_writer", "iterable", "iterate", "lazily",
           "next_deadline"]

# Puts a stream item into the message that carries it (`StreamItem` or `MuxEvent`: both have `value`
# and `patch`).
PutItem = Callable[[Any, Any], None]


# A stream whose items cost the event loop at least PACE_MIN_S each to put is not given its next item
# before PACE_FACTOR times that cost has passed (see Pace).
PACE_MIN_S = 0.002
PACE_FACTOR = 3.0


@dataclass
class Pace:
    """How long putting a stream's items held the worker's event loop, so that no one stream's items
    take most of it.

    Why: every stream of a worker is served by one event loop, and an item is put in one go. Most
    items cost microseconds, but a whole item can cost tens of milliseconds: a CUMULATIVE
    generation's record holds every token's logprobs so far, so with 20 logprobs a 1,400-token item
    is ~2.6 MB and ~35 ms to encode, again for every token. Sent as fast as the engine makes them,
    such items would hold the loop most of the time, and every other stream of the worker would
    wait behind each of them. So after items that cost at least PACE_MIN_S, the stream waits
    PACE_FACTOR times as long before it asks for its next one: it then uses at most a quarter of
    the loop. Nothing is lost meanwhile: vLLM merges a request's outputs while nobody asks (a
    CUMULATIVE item holds all the ones before it; DELTA outputs are joined), as it does for a slow
    reader or a coalescing interval; such a stream gets fewer, larger items, and the same tokens.

    The cost is wall time (a CPU clock would cost more than most items), so a put during which the
    process lost its core looks dear. The lesser of the last two items' costs decides: an item's
    size changes little from one to the next, and one unlucky put does not hold back a stream. A
    dear item (a put of PACE_MIN_S / 4 or more) also counts what sending its bytes costs after the
    put, as a turn does for a result (`turns.SEND_S_PER_BYTE`): a 16 MB item of text is put by one
    copy, ~5 ms, and copied two or three times more on its way out."""

    spent: float = 0.0      # seconds spent putting items since the stream last asked for one
    last: float = 0.0       # what the item before cost

    def timed(self, put: PutItem) -> PutItem:
        def put_timed(item: Any, msg: Any) -> None:
            started = time.perf_counter()
            try:
                put(item, msg)
            finally:
                spent = time.perf_counter() - started
                if spent >= PACE_MIN_S / 4 and msg is not None:
                    spent += msg.ByteSize() * SEND_S_PER_BYTE
                self.spent += spent
        return put_timed

    def rest_s(self) -> float:
        """How long the stream waits before asking for its next item (and the count starts again)."""
        cost = min(self.spent, self.last)
        self.last, self.spent = self.spent, 0.0
        return cost * PACE_FACTOR if cost >= PACE_MIN_S else 0.0


def item_writer(encoder: Callable[[bool], Encoder], encoding: str | None) -> PutItem:
    """How one stream's items go into their messages: whole Values (FULL), or patches against the
    item before (PATCH_V1, or PATCH_V2 with rows: as the caller asked). `encoder(stream)` makes the
    encoder: for a stream of whole values, one that remembers the fields that stay the same object."""
    if encoding == STREAM_PATCH_V1 or encoding == STREAM_PATCH_V2:
        return Patcher(encoder(False), rows=encoding == STREAM_PATCH_V2).put
    whole = encoder(True)

    def put(item: Any, msg: Any) -> None:
        whole.encode_into(item, msg.value)
    return put


async def iterate(source: Any, label: str, deadlines: Deadlines,
                  in_thread: Callable[[Callable[[], Any]], Awaitable[Any]], interval_s: float | None = None,
                  pace: Pace | None = None) -> AsyncGenerator[Any, None]:
    """The items of what a streaming call returned (an async generator, or an iterator stepped in a
    thread by `in_thread`), within the stream's deadlines, coalesced to one per `interval_s`, and
    paced by what putting them costs (`pace`, filled by the stream's put)."""
    if is_async_iterable(source):
        try:
            agen = source.__aiter__()
        except Exception as exc:    # the called code's own failure, mapped as for Call
            raise BridgeError.from_exception(exc, label) from exc
        step: Callable[[], Any] = agen.__anext__
        done_exc: type[BaseException] = StopAsyncIteration
        close = getattr(agen, "aclose", None)
    elif iterable(source):
        try:
            it = iter(source)
        except Exception as exc:
            raise BridgeError.from_exception(exc, label) from exc
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
            if not first and deadlines.total is not None and time.monotonic() >= deadlines.total:
                # The watchdog cancels only a stream that waits: one whose next item is always ready
                # (coalesced, or a reader slower than the engine) would never wait, and never end.
                raise BridgeError.timeout(f"{label}: deadline exceeded while streaming", target=label)
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
            rest = pace.rest_s() if pace is not None else 0.0
            if (interval_s or rest) and getattr(item, "finished", None) is not True:
                # (An item that says it finished its stream, as vLLM's outputs do, is its last: the
                # stream ends now rather than an interval later, and frees its slot.)
                # Coalescing: not asking for the next item yet lets vLLM merge the outputs that
                # arrive meanwhile into one (its per-request collector), so fewer messages carry
                # the same tokens. The first item is never held back.
                pause = max(rest, sent + (interval_s or 0.0) - time.monotonic())
                if deadlines.total is not None:      # the deadline cuts the pause short, then ends the stream
                    pause = min(pause, deadlines.total - time.monotonic())
                await asyncio.sleep(max(0.0, pause))
    finally:
        watchdog.close()
        if close is not None:
            try:
                result = close()
                if inspect.isawaitable(result):
                    await result
            except Exception:  # closing is best effort: the stream's outcome is already decided
                pass


def is_async_iterable(obj: object) -> bool:
    return callable(getattr(type(obj), "__aiter__", None))


def iterable(obj: object) -> bool:
    """Whether a stream can walk obj's items (text, bytes and maps go whole, with Call). Asked of the
    type, as `iter()` does: an object whose `__getattr__` answers every name (vLLM's platform
    object) has every attribute, `__iter__` included, and is still not iterable."""
    return is_async_iterable(obj) or (callable(getattr(type(obj), "__iter__", None))
                                      and not isinstance(obj, (str, bytes, dict)))


def lazily(obj: object) -> object:
    """What ITERATE walks: obj, but a tensor row by row as they are asked for. A tensor's own
    iterator splits it into a view per row at once: 3 million rows held the event loop 3.5 s and
    kept 2 GB of views for as long as the stream's state lived."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor) and obj.dim() > 0:
        return (obj[i] for i in range(obj.shape[0]))
    return obj


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
