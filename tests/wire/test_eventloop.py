"""The choice of event loop (bridge_server/wire/eventloop.py): each name gives that loop, a bad one is refused."""

from __future__ import annotations

import asyncio

import pytest

from bridge_server.wire import eventloop


async def running_loop_name() -> str:
    await asyncio.sleep(0)
    return eventloop.loop_name(asyncio.get_running_loop())


@pytest.mark.parametrize("name", eventloop.LOOPS)
def test_each_loop_runs_on_its_own_kind_of_loop(name: str) -> None:
    assert eventloop.run(running_loop_name(), name) == name


def test_the_default_is_uvloop() -> None:
    assert eventloop.run(running_loop_name()) == "uvloop"


def test_an_unknown_loop_is_refused_by_name(recwarn: pytest.WarningsRecorder) -> None:
    with pytest.raises(ValueError, match="event loop: expected one of uvloop, asyncio, got 'trio'"):
        eventloop.run(running_loop_name(), "trio")
    assert not [w for w in recwarn if "never awaited" in str(w.message)]


_FRAGMENTED_HEAP = """
import threading
import time
from bridge_server.wire import eventloop

def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024

def burst():      # what a thread that took large requests in small pieces leaves in its arena
    pieces = []
    for i in range(20_000):
        pieces.append(bytearray(16 << 10))
        if i % 64 == 0:
            keep.append(bytearray(1 << 10))     # pieces still in use among them: nothing at the top to give back
    del pieces

keep = []
base = rss_mb()
thread = threading.Thread(target=burst)
thread.start()
thread.join()
time.sleep(0.5)
held = rss_mb()
trim = eventloop._heap_trimmer()
free = trim(eventloop.TRIM_FREE_BYTES)
print(base, held, free >> 20, rss_mb())
"""


def test_memory_a_heap_holds_free_goes_back_to_the_system() -> None:
    """glibc keeps what a thread frees in that thread's arena: gRPC's threads took thirty 60 MiB
    requests in small pieces, and the pool server held 1.1 GB after, for good. What the heap holds
    free is given back (the pool server trims every TRIM_INTERVAL_S, off its loop)."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FRAGMENTED_HEAP], capture_output=True, text=True, timeout=120,
                         check=True).stdout
    base, held, free, after = map(int, out.split())
    assert held - base > 250, out          # 320 MB freed, and kept
    assert free > 250, out                 # seen as free by the trimmer
    assert after - base < 100, out         # and given back
