"""Which asyncio event loop a process of ours runs on: uvloop (the default) or asyncio's own; and
its heap: frozen once it has started, with large buffers given back to the system when freed.

Why it is a choice at all, and why uvloop by default: a call through the pool server is a handful of
loop turns and socket reads in the server (the caller's gRPC call, the lane write, the lane reply,
the gRPC reply), and on our machines asyncio's pure-Python loop spends ~0.1 ms more CPU per
forwarded call than libuv's, which shows as ~8 points of router overhead at p50 and ~12 points of
throughput (`bench_router` runs both in the same run). asyncio's loop stays available for debugging
(its debug mode, its tooling) and for platforms without uvloop.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import inspect
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
LOOPS = ("uvloop", "asyncio")
DEFAULT_LOOP = "uvloop"


def loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    if name == "uvloop":
        import uvloop
        return uvloop.new_event_loop
    if name == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"event loop: expected one of {', '.join(LOOPS)}, got {name!r}")


def run(main: Coroutine[Any, Any, T], loop: str = DEFAULT_LOOP) -> T:
    """`asyncio.run(main)` on the named loop."""
    try:
        factory = loop_factory(loop)
    except ValueError:
        main.close()     # never awaited: say nothing about it, the ValueError says it all
        raise
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(main)


def loop_name(loop: asyncio.AbstractEventLoop) -> str:
    """The name a log line gives the running loop, one of LOOPS for ours."""
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"


def freeze_heap() -> None:
    """Takes what exists once a server has started (vLLM, torch, the catalog, an engine's front-end:
    ~500,000 tracked objects) out of the garbage collector's sight. A full collection of that heap
    stops the event loop for ~250 ms, and serving eventually triggers one, in the middle of every
    running stream; frozen, the collector looks only at what serving itself allocates. Call it once
    start-up is over, before reporting SERVING."""
    gc.collect()
    gc.freeze()


_M_MMAP_THRESHOLD = -3     # glibc's mallopt parameter


def return_large_buffers(threshold: int = 1 << 20) -> None:
    """Replies and requests of megabytes pass through our servers. glibc serves a buffer that large
    from its heap once one has been freed (its mmap threshold rises to the largest freed), and a
    heap keeps the pages a burst took: a server that relayed a few hundred MB once holds them for
    good. A fixed threshold maps each such buffer on its own, so it goes back when freed. Nothing
    happens where the C library has no `mallopt` (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    mallopt(_M_MMAP_THRESHOLD, threshold)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]


def _heap_trimmer() -> Callable[[int], int] | None:
    """A function that gives the heap's free memory back to the system when its arenas hold at least
    the given bytes free, and says how many they held; None without glibc's `mallinfo2` and
    `malloc_trim`."""
    try:
        libc = ctypes.CDLL(None)
        mallinfo2, malloc_trim = libc.mallinfo2, libc.malloc_trim
    except (OSError, AttributeError):
        return None
    mallinfo2.restype = _MallInfo2
    malloc_trim.argtypes = [ctypes.c_size_t]

    def trim(at_least: int) -> int:
        free = int(mallinfo2().fordblks)
        if free >= at_least:
            malloc_trim(0)
        return free
    return trim


TRIM_INTERVAL_S = 10.0
TRIM_FREE_BYTES = 64 << 20


async def trim_heap(interval_s: float = TRIM_INTERVAL_S, at_least: int = TRIM_FREE_BYTES) -> None:
    """Runs for a server's life: every `interval_s`, memory its heap holds free, `at_least` of it,
    goes back to the system. gRPC's threads take a large request in many small pieces, and glibc
    keeps what each thread frees in that thread's arena, which a fixed mmap threshold does not
    reach (`return_large_buffers` covers single large buffers): thirty requests of 60 MiB left the
    pool server holding 1.1 GB for good, more after each burst. Counting and trimming walk every
    arena, so both run in a thread, off the event loop."""
    trim = _heap_trimmer()
    if trim is None:
        return
    loop = asyncio.get_running_loop()
    while True:
        await asyncio.sleep(interval_s)
        await loop.run_in_executor(None, trim, at_least)


def never_ran(task: asyncio.Task[Any]) -> bool:
    """Whether a task's coroutine has not begun. Cancelled now, it never will: none of its code runs,
    its `except CancelledError` included, so whatever it would say on the way out (a call's
    CANCELLED event, giving back its place) must be said by whoever cancels it. A start and its
    cancel in one Multiplex batch left such calls unanswered, and their worker slots taken for good."""
    return inspect.getcoroutinestate(task.get_coro()) == inspect.CORO_CREATED  # type: ignore[arg-type]
