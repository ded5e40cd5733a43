"""What a server keeps of a request it refuses: nothing, once the refusal is sent. gRPC keeps the
exception an abort raises with the RPC's state, and its traceback holds the handler's frames, the
request with them, in a cycle with that state: only a full collection freed them, and a stranger's
refused 60 MB requests stayed (120 MB a health check, 60 MB a Call), a gigabyte before one came.

Real gRPC servers in this process, over real sockets, with the garbage collector off throughout: what
the refusals leave is what reference counting alone frees."""

from __future__ import annotations

import asyncio
import gc
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health, health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from bridge_server.pool.forward import Forwarder
from bridge_server.pool.metrics import Metrics
from bridge_server.pool.router import Router
from bridge_server.wire.open_services import HealthWatches, health_and_status, reflection_service
from bridge_server.wire.protocol import MUX_MAX_BATCH
from tests.conftest import free_port
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import pool_pb2

MB = 1 << 20
SIZE = 20 * MB
TIMES = 5


@pytest.fixture()
def no_collection() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def _status(request: Any, context: Any) -> Any:
    return pool_pb2.StatusReply()


def _requests(address: str) -> list[Callable[[grpc.Channel], Any]]:
    """Each refused as too large or not its message: a health check, a reflection request, a Call, a
    Multiplex batch over the limit (its stream ends, its caller still sending)."""
    big_name = health_pb2.HealthCheckRequest(service="s" * SIZE).SerializeToString()
    reflect = reflection_pb2.ServerReflectionRequest(file_containing_symbol="x" * SIZE).SerializeToString()
    garbage = b"\xff" * SIZE
    start = pb.MuxRequest(start=pb.MuxStart(id=1, call=pb.CallRequest(args=[pb.Value(bytes=b"x" * 300)])))
    too_many = pb.MuxRequest(batch=pb.MuxBatch(requests=[start] * (MUX_MAX_BATCH + 1))).SerializeToString()

    def kept_open(first: bytes) -> Iterator[bytes]:      # a caller that never half-closes
        yield first
        time.sleep(30)
    return [
        lambda ch: ch.unary_unary("/grpc.health.v1.Health/Check")(big_name, timeout=30),
        lambda ch: list(ch.stream_stream("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo")(
            kept_open(reflect), timeout=30)),
        lambda ch: ch.unary_unary("/vllm_bridge.v1.Bridge/Call")(garbage, timeout=30),
        lambda ch: list(ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex")(kept_open(too_many), timeout=30)),
    ]


def test_a_refused_request_is_not_kept_once_its_refusal_is_sent(no_collection: None) -> None:
    async def main() -> list[tuple[str, int]]:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 64 * MB)])
        server.add_generic_rpc_handlers(health_and_status(health.aio.HealthServicer(), _status, HealthWatches()))
        server.add_generic_rpc_handlers([reflection_service(("vllm_bridge.v1.Bridge",))])
        server.add_generic_rpc_handlers([Forwarder(Router([], "default"), Metrics()).handler()])
        port = free_port()
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        held = []
        try:
            with grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_send_message_length", 64 * MB)]) as ch:
                for i, send in enumerate(_requests(f"127.0.0.1:{port}")):
                    tracemalloc.start()
                    try:
                        for _ in range(TIMES):
                            with pytest.raises(grpc.RpcError) as err:
                                await asyncio.to_thread(send, ch)
                            assert err.value.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                        grpc.StatusCode.RESOURCE_EXHAUSTED), err.value
                        await asyncio.sleep(0.2)      # (the RPCs' ends, on this loop)
                        held.append((["health", "reflection", "Call", "Multiplex"][i], tracemalloc.get_traced_memory()[0]))
                    finally:
                        tracemalloc.stop()
        finally:
            await server.stop(None)
        return held

    # each refused request's bytes (and what was parsed of them) stayed, with gc off: TIMES x SIZE and more
    held = asyncio.run(main())
    assert all(nbytes < SIZE for _, nbytes in held), \
        f"bytes still held after {TIMES} refusals of {SIZE:,} bytes each: {held}"
