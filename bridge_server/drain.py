"""Draining a recycled worker: the wait between "no new calls" and "stop the process".

A drained worker still takes calls on its refs (the router sends those nowhere else), so the wait is
for its in-flight calls and for its live refs: a ref is state a client still means to use, and
stopping the worker would turn it into "worker lost". A client may never release, so the wait is
bounded; what it leaves behind is said in the worker's exit description, which the router's "worker
lost" errors quote.
"""

from __future__ import annotations

import asyncio
import logging
import time

import grpc

from bridge_server.forward import release_on
from bridge_server.router import Backend
from vllm_bridge.v1 import bridge_pb2 as pb

log = logging.getLogger("vllm_bridge.supervisor")

REF_POLL_S = 0.5     # how often a worker with no calls left is asked for its live refs


async def refs_held(backend: Backend) -> int | None:
    """The refs the worker holds now, asked of the worker itself, since refs also go by idle TTL
    unseen by the router; None when it does not answer."""
    try:
        await release_on(backend, pb.ReleaseRequest(), (), REF_POLL_S * 4)
    except grpc.aio.AioRpcError:
        return None
    return backend.refs


async def drain(backend: Backend, exited: asyncio.Event, timeout_s: float) -> str:
    """Waits until the worker has no calls and no refs, has exited, or `timeout_s` has passed;
    returns why it stops, for its exit description."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not exited.is_set():
        if not backend.in_flight and await refs_held(backend) == 0:
            break
        await asyncio.sleep(0.05 if backend.in_flight else REF_POLL_S)
    if backend.refs > 0 and not exited.is_set():
        why = (f"recycled with {backend.refs} live ref{'s' if backend.refs > 1 else ''} "
               f"after drain_timeout_s {timeout_s:g} s")
        log.warning("pool %s: worker %s %s; calls that use them will fail with 'worker lost'", backend.pool,
                    backend.id, why)
        return why
    return "recycled"
