"""What clients that are not ours send, and how the server heals: each failure ends alone, nothing
shared (a lane, a Multiplex stream, a worker, an engine) is harmed, health tells the truth, and a
broken engine is replaced without anyone's help. Real processes, a real engine, real sockets.

The pool server is `stranger_server` (conftest.py), shared with the fuzz suite, which runs first: pool
`e` (one worker publishing an engine, probed every second) and pool `p` (one worker, no engine).
"""

from __future__ import annotations

import ctypes
import math
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.client.client import BridgeClient, CallError, Target
from bridge_server.pool.workerproc import lane_path
from bridge_server.tools.tiny_model import ensure_tiny_model
from tests.conftest import multiplex_clients_leave_blocked
from tests.pool.harness import Gate, PoolServer, in_thread, open_gates, others_calling, start_pool_server, wait_until
from tests.worker.test_engine import greedy
from vllm_bridge.v1 import bridge_pb2 as pb

D = "vllm.distributed"
GENERATE = Target.method("engine", "generate")
RPCS = {m: f"/vllm_bridge.v1.Bridge/{m}" for m in ("Call", "Stream", "Collective", "Release", "Describe")}


@pytest.fixture(scope="module")
def server(stranger_server: PoolServer) -> PoolServer:
    return stranger_server


@pytest.fixture()
def client(server: PoolServer) -> Iterator[BridgeClient]:
    with server.client(pool="e") as c:
        yield c


def health(server: PoolServer, service: str = "") -> int:
    with grpc.insecure_channel(server.address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status)


SERVING = health_pb2.HealthCheckResponse.SERVING


def tokens(client: BridgeClient, request_id: str, n: int = 8, timeout: float = 30) -> list[int]:
    items = list(client.stream(GENERATE, "The quick brown fox", greedy(n), request_id, timeout=timeout))
    return list(items[-1]["outputs"][0]["token_ids"])


def assert_untouched(server: PoolServer, client: BridgeClient) -> None:
    """Nothing shared was harmed: the same worker answers at once, nothing restarted, health SERVING."""
    t0 = time.monotonic()
    assert client.call(f"{D}.divide", 6, 3, timeout=5) == 2
    assert time.monotonic() - t0 < 2
    for name in ("e", "p"):
        pool = server.pool(name)
        assert pool.state == "serving" and pool.restarts == 0, pool
        assert all(w.state == "ready" for w in pool.workers), pool
    assert health(server) == SERVING and health(server, "pool/e") == SERVING


def raw_call(server: PoolServer, rpc: str, payload: bytes, timeout: float = 10) -> tuple[grpc.StatusCode, str, float]:
    t0 = time.monotonic()
    with grpc.insecure_channel(server.address) as ch:
        try:
            if rpc == "Stream":
                list(ch.unary_stream(RPCS[rpc])(payload, timeout=timeout))
            else:
                ch.unary_unary(RPCS[rpc])(payload, timeout=timeout)
        except grpc.RpcError as err:
            return err.code(), err.details() or "", time.monotonic() - t0   # type: ignore[attr-defined]
    return grpc.StatusCode.OK, "", time.monotonic() - t0


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field, written by hand: protobuf itself refuses to build messages
    nested this deep."""
    size, length = len(payload), b""
    while True:
        byte, size = size & 0x7F, size >> 7
        length += bytes([byte | (0x80 if size else 0)])
        if not size:
            return bytes([number << 3 | 2]) + length + payload


def nested_call(depth: int) -> bytes:
    value = pb.Value(int=1).SerializeToString()
    for _ in range(depth):
        value = _field(8, _field(1, value))        # Value.list -> Items.items
    target = pb.Target(kind=pb.Target.FUNCTION, name=f"{D}.divide").SerializeToString()
    return _field(1, target) + _field(2, value)     # CallRequest.target, CallRequest.args


MALFORMED = {
    "2 bytes": b"\x0a\x01",
    "invalid UTF-8 in the target name": b"\x0a\x05\x12\x03\xff\xfe\xfd",
    "a value nested 60 lists deep": nested_call(60),
    "a truncated field": pb.CallRequest(target=pb.Target(kind=1, name="x" * 50)).SerializeToString()[:-7],
}


@pytest.mark.parametrize("what", list(MALFORMED))
@pytest.mark.parametrize("rpc", ["Call", "Stream", "Collective", "Release", "Describe"])
def test_a_malformed_request_fails_alone_on_every_rpc(server: PoolServer, client: BridgeClient, rpc: str,
                                                      what: str) -> None:
    payload = MALFORMED[what]
    if rpc == "Collective":
        payload = _field(1, payload)       # CollectiveRequest.call holding the bad call
    elif rpc in ("Release", "Describe") and what == "a value nested 60 lists deep":
        payload = b"\x0a\x03\xff\xfe\xfd"                           # those carry strings, not values
    code, details, took = raw_call(server, rpc, payload)
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert "not a valid vllm_bridge.v1." in details and took < 5, (details, took)
    assert_untouched(server, client)


STANDARD_RPCS = {"/grpc.health.v1.Health/Check": ("grpc.health.v1.HealthCheckRequest", False),
                 "/grpc.health.v1.Health/Watch": ("grpc.health.v1.HealthCheckRequest", True),
                 "/vllm_bridge.v1.Pool/Status": ("vllm_bridge.v1.StatusRequest", False)}


@pytest.mark.parametrize("payload", [b"\x0a\x01", b"\x0a\x03\xff\xfe\xfd"], ids=["truncated", "invalid UTF-8"])
@pytest.mark.parametrize("method", list(STANDARD_RPCS))
def test_a_malformed_request_to_health_or_status_is_refused_by_name_too(server: PoolServer, client: BridgeClient,
                                                                      method: str, payload: bytes) -> None:
    message, streams = STANDARD_RPCS[method]
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            if streams:
                list(ch.unary_stream(method)(payload, timeout=10))
            else:
                ch.unary_unary(method)(payload, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value   # type: ignore[attr-defined]
    assert f"not a valid {message}" in err.value.details(), err.value        # type: ignore[attr-defined]
    assert_untouched(server, client)


def test_a_malformed_multiplex_request_fails_only_its_call(server: PoolServer, client: BridgeClient) -> None:
    good = pb.MuxRequest(start=pb.MuxStart(id=3, call=pb.CallRequest(
        target=pb.Target(kind=pb.Target.FUNCTION, name=f"{D}.divide"), args=[pb.Value(int=6), pb.Value(int=3)])))
    bad_call = pb.MuxRequestView(start=pb.MuxStartView(id=2, call=MALFORMED["2 bytes"])).SerializeToString()
    requests = [b"\xff\xff\xff garbage", bad_call, good.SerializeToString(),
                pb.MuxRequest(start=pb.MuxStart(id=4, call=pb.CallRequest(target=pb.Target(kind=99)))).SerializeToString()]
    with grpc.insecure_channel(server.address) as ch:
        replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex")(iter(requests), timeout=10,
                                                                    metadata=(("x-bridge-pool", "e"),))
        events = {e.id: e for raw in replies for e in pb.MuxReply.FromString(raw).events}
    assert sorted(events) == [0, 2, 3, 4], events
    for call_id in (0, 2, 4):
        assert events[call_id].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], events[call_id]
    assert events[3].value.int == 2
    assert_untouched(server, client)


def test_a_function_given_a_receiver_is_refused_not_called_without_it(server: PoolServer, client: BridgeClient) -> None:
    """A function, a module attribute or a constructor has no receiver: one given with it means the
    caller meant something else, and is told so rather than the receiver dropped (through the pool
    server, and straight to a worker, where an unknown ref is not refused first)."""
    worker = server.pool("e").workers[0]
    receivers: list[dict[str, Any]] = [{"object": "engine"}, {"object": ""}, {"ref": pb.Ref(id="x")}]
    with BridgeClient(worker.address) as direct:
        for via, receiver in [(client, receivers[0]), *((direct, r) for r in receivers)]:
            target = pb.Target(kind=pb.Target.FUNCTION, name=f"{D}.divide", **receiver)
            with pytest.raises(CallError) as err:
                via.call(Target(target), 6, 3, timeout=10)
            given = next(iter(receiver))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value.details
            assert f"takes no receiver, got target.{given}" in err.value.details, err.value.details
    assert client.call(Target.fn(f"{D}.divide"), 6, 3, timeout=10) == 2
    assert_untouched(server, client)


def test_a_target_of_unknown_kind_and_no_name_is_answered(server: PoolServer, client: BridgeClient) -> None:
    code, details, took = raw_call(server, "Call", pb.CallRequest(target=pb.Target(kind=99)).SerializeToString())
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "target kind 99" in details and took < 5
    worker = server.pool("e").workers[0]
    with BridgeClient(worker.address) as direct, pytest.raises(CallError) as err:
        direct.call(Target(pb.Target(kind=99)), timeout=5)      # straight to the worker too
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert_untouched(server, client)


@pytest.mark.parametrize("case", [
    ("max_tokens: 3.0", ("Hi", {"max_tokens": 3.0}, "typed-1"), {}, "max_tokens", "expected int | None, got float 3.0"),
    ("max_tokens: true", ("Hi", {"max_tokens": True}, "typed-2"), {}, "max_tokens", "got bool True"),
    ("an int request_id", ("Hi", {"max_tokens": 3}, 5), {}, "request_id", "expected str, got int 5"),
    ("temperature: nan", ("Hi", {"temperature": math.nan}, "typed-3"), {}, "temperature", "expected a finite number"),
    ("a float token id", ({"prompt_token_ids": [1, 2.5]}, {"max_tokens": 3}, "typed-4"), {}, "prompt",
     "prompt_token_ids[1]"),
    ("an int stop string", ("Hi", {"stop": ["a", 1]}, "typed-5"), {}, "stop", "expected str | list[str] | None"),
    ("a float priority", ("Hi", {"max_tokens": 3}, "typed-6"), {"priority": 1.5}, "priority", "expected int"),
    # True equals 1 (DELTA) and passed as it; vLLM's engine core then refused it and its input thread died
    ("output_kind: true", ("Hi", {"max_tokens": 3, "output_kind": True}, "typed-7"), {}, "output_kind",
     "got bool True"),
], ids=lambda c: c[0])
def test_a_wrongly_typed_argument_is_refused_before_vllm_and_the_engine_serves_on(
        server: PoolServer, client: BridgeClient, case: tuple[str, tuple[Any, ...], dict[str, Any], str, str]) -> None:
    _, args, kwargs, parameter, expected = case
    t0 = time.monotonic()
    with pytest.raises(CallError) as err:
        list(client.stream(GENERATE, *args, kwargs=kwargs, timeout=10))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.detail is not None and parameter in err.value.detail.parameter
    assert "vllm.AsyncLLMEngine.generate" in err.value.details and expected in err.value.details
    assert time.monotonic() - t0 < 5
    assert len(tokens(client, f"after-{parameter}-{time.monotonic()}", timeout=20)) == 8   # not wedged


def test_call_on_a_streaming_target_says_to_use_stream(server: PoolServer, client: BridgeClient) -> None:
    with pytest.raises(CallError) as err:
        client.call(GENERATE, "Hi", greedy(2), "unary-generate", timeout=10)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "Stream" in err.value.details
    assert err.value.reason == "use Stream"


def test_a_lora_method_on_an_engine_without_lora_says_why(server: PoolServer, client: BridgeClient) -> None:
    """vLLM's own failure there is a bare Exception from inside its core ("Call to add_lora method
    failed: LoRA is not enabled"), reported as UNKNOWN: a status that says neither that the call can
    never work on this engine nor why."""
    lora = {"lora_name": "a", "lora_int_id": 1, "lora_path": str(ensure_tiny_model() / "lora")}
    for method, args in (("list_loras", ()), ("add_lora", (lora,))):
        with pytest.raises(CallError) as err:
            client.call(Target.method("engine", method), *args, timeout=10)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, (method, err.value)
        assert err.value.reason == "lora disabled" and "enable_lora" in err.value.details, (method, err.value)
    with pytest.raises(CallError) as err:      # vLLM's: a bare ValueError, naming nothing
        list(client.stream(GENERATE, "Hi", greedy(2), "lora-off", kwargs={"lora_request": lora}, timeout=10))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "lora disabled", err.value
    assert err.value.detail is not None and err.value.detail.parameter == "lora_request", err.value
    assert client.call(Target.method("engine", "check_health"), timeout=10) is None


def test_a_multiplex_that_outlives_its_deadline_ends_quietly(server: PoolServer, client: BridgeClient) -> None:
    """The RPC's deadline ends it while the router waits to write to a caller that reads nothing: gRPC
    closes the stream's generator, which is the RPC's end, not a failure of the router (it logged
    one, with a traceback, each time)."""
    import queue
    before = len(server.log_text())
    request, _ = client.request(GENERATE, ("a long one", greedy(1500), "outlived"))
    outgoing: queue.Queue[Any] = queue.Queue()
    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=1, stream=True, call=request,
                                                 metadata={"x-bridge-pool": "e", "x-bridge-stream-encoding": "full"})))
    with grpc.insecure_channel(server.address, options=[("grpc.http2.bdp_probe", 0)]) as ch:
        replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                   pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=3)
        time.sleep(5)                  # reads nothing: the router's writes wait, and the deadline passes
        with pytest.raises(grpc.RpcError) as err:
            for _ in replies:
                pass
        outgoing.put(None)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
    wait_until(lambda: server.pool("e").in_flight == 0, timeout=30, what="its slot freed")
    time.sleep(0.5)
    log = server.log_text()[before:]
    assert "router failure" not in log and "Task exception was never retrieved" not in log, log[-3000:]


def test_a_release_of_millions_of_ids_is_refused_at_once(server: PoolServer, client: BridgeClient) -> None:
    """Grouping them by worker held the server's event loop for seconds, every caller's calls with it."""
    request = pb.ReleaseRequest(ref_ids=[f"w{i % 7}.x{i}" for i in range(100_001)]).SerializeToString()
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
        ch.unary_unary(RPCS["Release"])(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    assert "100,001 ref ids in one request" in err.value.details(), err.value.details()
    # Counted off the bytes before any parse, however their tags are spelled (0x8a 0x00 is field 1's
    # tag in two bytes): 3 million empty ids are never parsed.
    for spelled in (b"\n\x00", b"\x8a\x00\x00"):
        with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
            ch.unary_unary(RPCS["Release"])(spelled * 3_000_000, timeout=30)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "more than 100,000 fields in one request" in err.value.details(), err.value.details()
    assert client.call("vllm.distributed.divide", 6, 3, pool="p", timeout=10) == 2


def test_a_logger_name_the_worker_would_keep_for_good_is_bounded(server: PoolServer, client: BridgeClient) -> None:
    """init_logger registers its name in the process's logging for the process's life, one
    placeholder per dotted prefix: a name of 4,000 parts cost the worker 50 MB per call."""
    name = ".".join(f"part{j}" for j in range(4000))
    with pytest.raises(CallError) as err:
        client.call("vllm.distributed.init_logger", name, pool="p", timeout=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None
    assert err.value.detail.parameter == "name" and "over the limit of 200" in err.value.details, err.value
    assert client.call("vllm.distributed.init_logger", "bridge.test.short", pool="p", timeout=10) is not None


def test_a_prompt_that_cannot_fit_is_refused_at_once_and_blocks_nobody(server: PoolServer,
                                                                       client: BridgeClient) -> None:
    huge = "The cat sees a dog. " * 45_000           # 900 KB: under max_prompt_chars (1,000,000)
    with others_calling(server, "e") as slowest:
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            list(client.stream(GENERATE, huge, greedy(4), "huge", timeout=30))
        took = time.monotonic() - t0
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in err.value.details
    assert len(err.value.details) < 1500 and took < 5, took
    assert slowest and max(slowest) < 1.0, max(slowest)
    with pytest.raises(CallError) as err:           # 10 MB: over the limit, refused before anything looks at it
        list(client.stream(GENERATE, huge * 12, greedy(4), "huger", timeout=30))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_prompt_chars" in err.value.details


def test_an_error_quotes_only_a_prefix_of_what_the_client_sent(server: PoolServer, client: BridgeClient) -> None:
    with grpc.insecure_channel(server.address) as ch:      # a raw client: ours would list the ref in metadata
        call = ch.unary_unary("/vllm_bridge.v1.Bridge/Call")
        for target in (pb.Target(kind=pb.Target.FUNCTION, name="x" * 9000),
                       pb.Target(kind=pb.Target.METHOD, name="generate", object="e" * 9000),
                       pb.Target(kind=pb.Target.METHOD, name="x", ref=pb.Ref(id="q" * 9000)),
                       pb.Target(kind=pb.Target.METHOD, name="m" * 9000, object="engine")):
            with pytest.raises(grpc.RpcError) as err:
                call(pb.CallRequest(target=target).SerializeToString(), metadata=(("x-bridge-pool", "e"),), timeout=5)
            code, details = err.value.code(), err.value.details()   # type: ignore[attr-defined]
            assert code in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.PERMISSION_DENIED), (code, details)
            assert len(details) < 1200, len(details)
    assert_untouched(server, client)


def _nested(levels: int) -> pb.Value:
    value = pb.Value(int=1)
    for _ in range(levels):
        outer = pb.Value()
        outer.map.entries.add(key=pb.Value(str="k"), value=value)
        value = outer
    return value


def test_a_call_near_protobufs_depth_limit_is_answered_as_the_call_it_is(server: PoolServer,
                                                                         client: BridgeClient) -> None:
    """The pool server forwards a Call over its lane inside a MuxRequest, two levels deeper: a Call
    the pool server took, nested a little under protobuf's limit, was refused as "Multiplex: a
    request is not a valid MuxRequest", an RPC its client never made. It is the call it is."""
    request = _call(_nested(20))
    for n in range(21, 80):         # the deepest call protobuf takes
        try:
            deeper = _call(_nested(n))
        except Exception:
            break
        if not _parses(deeper):
            break
        request = deeper
    with pytest.raises(Exception):      # the lane's message would be over protobuf's depth
        pb.MuxRequest.FromString(pb.MuxRequest(start=pb.MuxStart(id=1, call=request)).SerializeToString())
    with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as err:
        ch.unary_unary("/vllm_bridge.v1.Bridge/Call")(request.SerializeToString(), timeout=10)
    code, details = err.value.code(), err.value.details()   # type: ignore[attr-defined]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "Multiplex" not in details, details
    assert "vllm.distributed.divide" in details, details
    assert_untouched(server, client)


def _call(arg: pb.Value) -> pb.CallRequest:
    return pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.divide"),
                          args=[arg, pb.Value(int=1)])


def _parses(message: pb.CallRequest) -> bool:
    try:
        pb.CallRequest.FromString(message.SerializeToString())
    except Exception:
        return False
    return True


def test_a_caller_that_stops_reading_frees_its_slots_and_its_engine_requests(server: PoolServer,
                                                                             client: BridgeClient) -> None:
    """Each way a caller can hold a worker slot by reading nothing of a stream (a Stream through the
    router, a Multiplex stream that never gives credit, a Stream straight to the worker) ends after
    the pool's reader_stall_s (6 s here; nobody waits for a slot meanwhile): the slot is free for
    others, vLLM aborts the request, and the caller, once it reads again, learns why."""
    worker = server.pool("e").workers[0]
    log = Path(server.log.parent) / "logs" / f"{worker.id}.log"
    quiet = [("grpc.http2.bdp_probe", 0)]    # a fixed 64 KiB window, filled after a few whole items
    full = {"stream_encoding": "full", "pool": "e"}
    many = greedy(1500)
    with BridgeClient(server.address, channel_options=quiet) as via_router, \
            BridgeClient(worker.address, channel_options=quiet) as direct, via_router.multiplex(pool="e") as mux:
        stalled = {
            "stalled-router": via_router.stream(GENERATE, "stop reading", many, "stalled-router", **full),
            "stalled-worker": direct.stream(GENERATE, "stop reading", many, "stalled-worker", **full),
            "stalled-mux": mux.stream(GENERATE, "stop reading", many, "stalled-mux", window=1),
        }
        for stream in stalled.values():
            assert next(stream)["finished"] is False
        wait_until(lambda: all(f"Request {rid} aborted" in log.read_text(errors="replace") for rid in stalled),
                   timeout=60, what="vLLM aborted every stalled stream's request")
        wait_until(lambda: server.pool("e").in_flight == 0, timeout=10, what="the stalled streams' slots freed")
        assert tokens(client, "after-stalls") and health(server) == SERVING
        for rid, stream in stalled.items():
            with pytest.raises(CallError) as err:
                for _ in stream:
                    pass
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, (rid, err.value)
            assert err.value.reason == "reader stalled" and "reader_stall_s" in err.value.details, (rid, err.value)


def test_a_flood_of_stalled_streams_leaves_room_and_turns_for_another_client(server: PoolServer,
                                                                             client: BridgeClient) -> None:
    """Two Streams through the router that their caller stops reading (a long generation, and a short
    one whose worker is done with it while the router's write still waits: its window never fills),
    two calls of a Multiplex stream whose client credits them and never reads (their windows never
    fill either; the Multiplex write's own bound is the longest reader_stall_s, 60 s for pool p),
    then one Multiplex stream that starts 900 generations and never reads past their first item:
    together they hold all 64 slots, and the rest queue. The flood may not take the last quarter of the queue, so another client still queues.
    While calls wait, a stream whose caller leaves its window unread ends after contended_stall_s (1 s
    here), not reader_stall_s (6 s), on either path: the other client's call is served within a few
    seconds, at the next freed slot, not behind the flood's 768 waiting calls (first in first out,
    minutes of stalls)."""
    import queue
    import threading
    request, _ = client.request(GENERATE, ("flood", greedy(64), "flood"))
    starts = [pb.MuxRequest(start=pb.MuxStart(id=i, stream=True, window=1, call=request,
                                              metadata={"x-bridge-pool": "e"})) for i in range(1, 901)]
    outgoing: queue.Queue[Any] = queue.Queue()
    refused: list[str] = []
    stalled: list[pb.MuxError] = []
    quiet = [("grpc.http2.bdp_probe", 0)]    # a fixed 64 KiB window, filled after a few whole items
    with grpc.insecure_channel(server.address) as ch, BridgeClient(server.address, channel_options=quiet) as other:
        # each whole item repeats the prompt: the window fills within a few items, whatever the engine's pace
        stream = other.stream(GENERATE, "stop reading " * 100, greedy(1500), "stalled-stream", stream_encoding="full",
                              pool="e")
        # ... and one whose worker is soon done with it: fewer items than a window, but more bytes
        short = other.stream(GENERATE, "hold the slot " * 180, greedy(24), "stalled-short", stream_encoding="full",
                             pool="e")
        assert next(stream)["finished"] is False and next(short)["finished"] is False
        credited_out: queue.Queue[Any] = queue.Queue()
        for i in (1, 2):
            long_request, _ = client.request(GENERATE, ("stop reading " * 100, greedy(1500), f"credited-{i}"))
            credited_out.put(pb.MuxRequest(start=pb.MuxStart(id=i, stream=True, window=8, call=long_request)))
        credited = grpc.insecure_channel(server.address, options=quiet)
        credited_replies = credited.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                                  pb.MuxReply.FromString)(
            iter(credited_out.get, None), timeout=120,
            metadata=(("x-bridge-pool", "e"), ("x-bridge-stream-encoding", "full")))
        time.sleep(0.5)
        for i in (1, 2):         # credit far ahead, without reading: the calls' windows never fill
            credited_out.put(pb.MuxRequest(credit=pb.MuxCredit(id=i, events=1_000_000)))
        # All wait on their caller before the flood comes (the pool counts them), so the sweep that
        # ends the flood's first stalled streams ends them too, at the latest.
        wait_until(lambda: server.pool("e").stalled_streams == 4, timeout=30,
                   what="both streams and both credited calls stalled")
        outgoing.put(pb.MuxRequest(batch=pb.MuxBatch(requests=starts)))
        flood = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                 pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120)

        def read() -> None:
            try:
                for reply in flood:
                    for e in reply.events:
                        if e.WhichOneof("kind") == "error":
                            refused.append(e.error.detail.reason)
                            if e.error.detail.reason == "reader stalled":
                                stalled.append(e.error)
            except grpc.RpcError:
                pass
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            wait_until(lambda: "client queue full" in refused, timeout=30,
                       what="the flood's calls past its share refused")
            assert server.pool("e").queue_length <= 768      # its share: the last quarter of 1,024 kept
            started = time.monotonic()
            assert len(tokens(client, "beside-the-flood", n=4, timeout=60)) == 4
            took = time.monotonic() - started
            assert took < 5, took       # under reader_stall_s (6 s): the shorter bound freed the slots
            wait_until(lambda: len(stalled) >= 62, timeout=30, what="the flood's first streams ended")
            for err in stalled:
                assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], err
                assert "contended_stall_s" in err.detail.message and "pool 'e'" in err.detail.message, err
            for left in (stream, short):
                with pytest.raises(CallError) as ended:
                    for _ in left:
                        pass
                assert ended.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
                assert ended.value.reason == "reader stalled" and "contended_stall_s" in ended.value.details, \
                    ended.value
            ends: dict[int, pb.MuxError] = {}
            for reply in credited_replies:        # what it left unread, then each call's end
                ends.update((e.id, e.error) for e in reply.events if e.WhichOneof("kind") == "error")
                if len(ends) == 2:
                    break
            for err in ends.values():
                assert err.detail.reason == "reader stalled" and "contended_stall_s" in err.detail.message, err
        finally:
            flood.cancel()
            outgoing.put(None)
            reader.join(10)
            credited_replies.cancel()
            credited_out.put(None)
            credited.close()
    wait_until(lambda: (p := server.pool("e")).in_flight == 0 and p.queue_length == 0, timeout=60,
               what="the flood's calls gone")
    assert_untouched(server, client)


def test_multiplex_clients_that_go_away_with_their_writes_blocked_free_their_slots_at_once(
        server: PoolServer, client: BridgeClient) -> None:
    """Clients credit their Multiplex calls, read nothing, start more, then cancel their RPCs and
    close their connections. The writes gRPC held back fail, and gRPC cancels each handler again
    while it cleans up: the calls kept their slots, counted in flight, until their worker gave up
    waiting for credit (reader_stall_s: 6 s here, 60 s by default), every bystander behind them."""
    def start(c: int, i: int) -> pb.CallRequest:
        prompt = "stop reading " * 100 if i < 5 else "more"
        return client.request(GENERATE, (prompt, greedy(1500), f"gone-{c}-{i}"))[0]
    multiplex_clients_leave_blocked(
        server.address, (("x-bridge-pool", "e"), ("x-bridge-stream-encoding", "full")), 4, start,
        lambda: wait_until(lambda: server.pool("e").stalled_streams >= 12, timeout=30, what="the calls' writes blocked"))
    wait_until(lambda: server.pool("e").in_flight == 0, timeout=4, what="the slots freed (not at reader_stall_s)")
    assert_untouched(server, client)


@pytest.mark.parametrize("where", ["router", "worker", "router-batch"])
def test_a_multiplex_client_that_never_reads_cannot_grow_the_server(server: PoolServer, where: str) -> None:
    """A stranger starts calls whose results are 7 MB each (a tensor of 900,000 ids) over one
    Multiplex stream and never reads a reply: one start at a time, or all in one batch (read whole
    before any result is back). The router holds at most its bounds (16 MiB of unwritten replies, 16
    unanswered calls, counted from their start), a worker what waits behind its one blocked write,
    and then neither starts more of the stream's calls: memory stays put, where holding every
    result took 7 MB a call. Other clients are served meanwhile."""
    import queue

    import torch
    worker = server.pool("p").workers[0]
    address = worker.address if where == "worker" else server.address
    process = psutil.Process(worker.pid if where == "worker" else server.proc.pid)
    with BridgeClient(address, options=None) as client:
        dp = client.call("vllm.forward_context.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]), pool="p",
                         session_id="never-reads", timeout=10)
        request, refs = client.request(Target.method(dp, "cu_tokens_across_sp"), (300_000,))   # 900,000 ids
        outgoing: queue.Queue[Any] = queue.Queue()
        with grpc.insecure_channel(address) as ch:
            replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                       pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120, metadata=(
                                           ("x-bridge-pool", "p"), ("x-bridge-session", "never-reads"),
                                           ("x-bridge-refs", ",".join(refs))))
            try:
                outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=1, call=request)))
                time.sleep(2.0)         # its result is unread now; the process's baseline is what follows
                before = process.memory_info().rss
                if where == "router-batch":
                    outgoing.put(pb.MuxRequest(batch=pb.MuxBatch(requests=[
                        pb.MuxRequest(start=pb.MuxStart(id=i, call=request)) for i in range(2, 122)])))
                for i in range(2, 62) if where != "router-batch" else ():
                    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=i, call=request)))
                    time.sleep(0.05)
                time.sleep(3.0)
                grown = process.memory_info().rss - before
                assert grown < 400 * 2**20 if where == "router-batch" else grown < 150 * 2**20, \
                    f"the {where} grew {grown / 2**20:.0f} MB for unread 7 MB results"
                assert client.call(f"{D}.divide", 6, 3, pool="p", timeout=10) == 2
            finally:
                replies.cancel()
                outgoing.put(None)
        client.release(dp)
    with server.client(pool="e") as other:
        assert_untouched(server, other)


def unread(server: PoolServer) -> tuple[float, float]:
    """The router's unread reply bytes and streams ended for them, from its metrics."""
    import urllib.request
    body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
    values = dict(line.rsplit(" ", 1) for line in body.splitlines() if line.startswith("vllm_bridge_unread"))
    return float(values["vllm_bridge_unread_reply_bytes"]), float(values["vllm_bridge_unread_streams_ended_total"])


def test_callers_that_never_read_on_many_streams_cannot_grow_the_router(server: PoolServer) -> None:
    """One caller opens 24 Multiplex streams on its connection, and on each starts 4 calls whose
    results are 7 MB, and never reads. Each stream keeps to its own bound (16 MiB unwritten), but
    together they would hold ~690 MB. Past the router's max_unread_bytes (48 MiB here) its results
    no longer fit (their calls end with RESOURCE_EXHAUSTED, "unread replies"), and its streams left
    unread are ended, which frees what they queued (a write gRPC holds stays until the caller reads
    or goes). Another caller reading the same results over its own connection gets every one of
    them; the router counted replies read as they came only while they crossed, and nothing once
    the hoarder went."""
    STREAMS = 24
    import queue

    import torch

    process = psutil.Process(server.proc.pid)
    md = (("x-bridge-pool", "p"), ("x-bridge-session", "hoards"))
    with BridgeClient(server.address, options=None) as client:
        dp = client.call("vllm.forward_context.DPMetadata", torch.tensor(7), torch.tensor([5, 7, 3]), pool="p",
                         session_id="hoards", timeout=10)
        request, refs = client.request(Target.method(dp, "cu_tokens_across_sp"), (300_000,))   # 900,000 ids
        metadata = (*md, ("x-bridge-refs", ",".join(refs)))
        for _ in range(3):      # replies read as they come count only while they cross
            assert len(client.call(Target.method(dp, "cu_tokens_across_sp"), 300_000, pool="p",
                                   session_id="hoards", timeout=30)) == 900_000
        wait_until(lambda: unread(server)[0] == 0, timeout=10, what="no reply left unread")
        ended_before = unread(server)[1]
        before = process.memory_info().rss
        # Two connections (each channel its own subchannel): two callers. The hoarder's channel does
        # not probe the bandwidth-delay product: with it, gRPC grows the window its transport reads
        # ahead into, and at times took all 96 results in on the caller's side, unread.
        big = [("grpc.max_receive_message_length", 64 * 2**20), ("grpc.use_local_subchannel_pool", 1)]
        with grpc.insecure_channel(server.address, [*big, ("grpc.http2.bdp_probe", 0)]) as hoarder, \
                grpc.insecure_channel(server.address, big) as reader:
            def open_stream(ch: grpc.Channel, n: int) -> tuple[queue.Queue[Any], Any]:
                outgoing: queue.Queue[Any] = queue.Queue()
                for i in range(1, n + 1):
                    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=i, call=request)))
                replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                           pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120,
                                                                   metadata=metadata)
                return outgoing, replies

            hoarding = [open_stream(hoarder, 4) for _ in range(STREAMS)]
            try:
                wait_until(lambda: server.pool("p").in_flight == 0, timeout=60, what="the hoarder's calls answered")
                outgoing, replies = open_stream(reader, 1)      # one call at a time, each read as it comes
                results = []
                for reply in replies:
                    results += [e for e in reply.events if e.WhichOneof("kind") == "value"]
                    if len(results) == 6:
                        break
                    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=len(results) + 1, call=request)))
                outgoing.put(None)
                assert len(results) == 6
                grown = process.memory_info().rss - before
                every = STREAMS * 4 * 7_200_000      # what holding every result would take (over 1.2 GB measured)
                assert grown < 0.75 * every, f"the router grew {grown / 2**20:.0f} MB"
                assert client.call(f"{D}.divide", 6, 3, pool="p", timeout=10) == 2
                ended = refused = 0       # streams ended; results that did not fit (their calls ended)
                for out, replies in hoarding:
                    out.put(None)
                    try:
                        for reply in replies:
                            for e in reply.events:
                                if e.WhichOneof("kind") == "error":
                                    assert e.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], e.error
                                    assert "max_unread_bytes" in e.error.message, e.error
                                    refused += 1
                    except grpc.RpcError as err:
                        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err   # type: ignore[attr-defined]
                        assert "max_unread_bytes" in err.details(), err   # type: ignore[attr-defined]
                        ended += 1
                assert refused >= 48, (ended, refused)     # of its 96: about 7 fit in 48 MiB
            finally:
                for out, replies in hoarding:
                    out.put(None)
                    replies.cancel()
        wait_until(lambda: unread(server)[0] == 0, timeout=10, what="nothing held once the hoarder went")
        assert unread(server)[1] >= ended_before + ended
        client.release(dp)
    with server.client(pool="e") as other:
        assert_untouched(server, other)


def test_refusals_left_unread_count_in_the_bound_and_one_id_is_refused_once_a_reply(server: PoolServer,
                                                                                   client: BridgeClient) -> None:
    """Starts the pool server refuses itself (a ref id that is none) are events like results: left
    unread they count in max_unread_bytes, and go with their stream. A batch of one id's start
    repeated is refused once per reply, not once per copy (64 unread streams of 65,536 such starts
    each took the pool server to 2 GB, and its loop whole: no other client was answered for 45 s)."""
    request, _ = client.request(f"{D}.divide", (6, 3))
    bad = {"x-bridge-refs": "a"}
    same = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest(start=pb.MuxStart(id=7, call=request,
                                                                                      metadata=bad))] * 5000))
    distinct = pb.MuxRequest(batch=pb.MuxBatch(requests=[
        pb.MuxRequest(start=pb.MuxStart(id=i, call=request, metadata=bad)) for i in range(1, 20_001)]))
    md = (("x-bridge-pool", "p"),)
    with grpc.insecure_channel(server.address) as ch:
        replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                   pb.MuxReply.FromString)(iter([same]), timeout=60, metadata=md)
        events = [e for r in replies for e in r.events]
    assert events and all(e.id == 7 and e.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0] for e in events)
    assert len(events) < 5000 // 64 + 8, len(events)           # once for each reply at most
    wait_until(lambda: unread(server)[0] == 0, timeout=10, what="nothing held before")
    with grpc.insecure_channel(server.address, [("grpc.http2.bdp_probe", 0)]) as hoarder:
        replies = hoarder.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                        pb.MuxReply.FromString)(iter([distinct]), timeout=60, metadata=md)
        wait_until(lambda: unread(server)[0] > 1 << 20, timeout=30, what="the unread refusals counted")
        assert client.call(f"{D}.divide", 6, 3, pool="p", timeout=10) == 2
        replies.cancel()
    wait_until(lambda: unread(server)[0] == 0, timeout=10, what="nothing held once the stream went")


def test_a_rank_of_thousands_of_digits_is_refused_by_name_and_ends_only_its_call(server: PoolServer,
                                                                                  client: BridgeClient) -> None:
    """int() refuses text of over 4,300 digits with a ValueError the router did not expect: a plain
    Call got INTERNAL "router failure", and a Multiplex start carrying it ended the whole stream,
    with every other call on it (an Elixir application shares one stream per server)."""
    rank = "1" * 5000
    request, _ = client.request(f"{D}.divide", (6, 3))
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as raw:
            ch.unary_unary(RPCS["Call"])(request.SerializeToString(), timeout=10,
                                         metadata=(("x-bridge-pool", "p"), ("x-bridge-rank", rank)))
        assert raw.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raw.value   # type: ignore[attr-defined]
        assert "x-bridge-rank" in raw.value.details() and len(raw.value.details()) < 2000   # type: ignore[attr-defined]
        starts = [pb.MuxRequest(start=pb.MuxStart(id=1, call=request, metadata={"x-bridge-rank": rank})),
                  pb.MuxRequest(start=pb.MuxStart(id=2, call=request))]
        replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                   pb.MuxReply.FromString)(iter(starts), timeout=30, metadata=(("x-bridge-pool", "p"),))
        events = {e.id: e for r in replies for e in r.events}
    assert events[1].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], events[1]
    assert events[1].error.detail.parameter == "x-bridge-rank", events[1]
    assert events[2].WhichOneof("kind") == "value", events[2]          # the stream went on


def test_large_multiplex_requests_count_in_the_bound_while_their_calls_wait(tmp_path: Path) -> None:
    """A Multiplex start of 256 KiB or more is held by the pool server until its call ends (waiting
    for a slot, then for its turn in the worker's lane), as a large Call is: its bytes count in
    max_unread_bytes (32 MiB here), and past it and the caller's share, further large starts fail
    at once (RESOURCE_EXHAUSTED, "large requests") rather than pile up uncounted while they wait.
    Those that fit wait for the slot, run once it is free, and count no more."""
    import queue
    import threading
    server = start_pool_server(tmp_path, 'max_unread_bytes = 33554432\n[[pools]]\nname = "q"\nworkers = 1\n'
                                         'max_concurrent = 1\n', metrics=True)
    gate = Gate()
    try:
        with BridgeClient(server.address) as client:
            holder = in_thread(lambda: client.call(*gate.args(), pool="q", timeout=120))
            wait_until(gate.running, timeout=60, what="the gate holding the pool's one slot")
            request, _ = client.request(f"{D}.divide", (b"x" * (6 << 20), 3))      # 6 MiB each
            outgoing: queue.Queue[Any] = queue.Queue()
            for i in range(1, 13):
                outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=i, call=request)))
            events: list[Any] = []
            with grpc.insecure_channel(server.address, [("grpc.max_send_message_length", 64 << 20)]) as ch:
                replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                           pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120,
                                                                   metadata=(("x-bridge-pool", "q"),))
                reader = threading.Thread(target=lambda: [events.extend(r.events) for r in replies], daemon=True)
                reader.start()
                wait_until(lambda: len(events) >= 7, timeout=60, what="the starts that do not fit refused")
                time.sleep(0.5)
                refused = [e for e in events if e.WhichOneof("kind") == "error"]
                assert len(events) == len(refused) == 7, events       # 5 x 6 MiB fit in 32 MiB, the rest not
                for e in refused:
                    assert e.error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0], e.error
                    assert e.error.detail.reason == "large requests" and "does not fit" in e.error.message, e.error
                assert 30 << 20 <= unread(server)[0] <= 64 << 20     # the five waiting, counted
                open_gates([gate])
                holder.done.wait(60)
                outgoing.put(None)
                reader.join(60)
            answered = [e for e in events[7:] if e.WhichOneof("kind") == "error"]
            assert len(answered) == 5 and all(e.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                                              for e in answered), answered   # run: divide takes numbers
            wait_until(lambda: unread(server)[0] == 0, timeout=10, what="nothing held once their calls ended")
            assert client.call(f"{D}.divide", 6, 3, pool="q", timeout=10) == 2
            # A batch of many small starts, whatever its bytes, counts what it holds parsed (a batch under
            # 256 KiB of 26,000 tiny starts held 10 MB): 200 starts of a few bytes, here waiting for the slot.
            gate = Gate()
            holder = in_thread(lambda: client.call(*gate.args(), pool="q", timeout=120))
            wait_until(gate.running, timeout=60, what="the gate holding the pool's one slot again")
            small, _ = client.request(f"{D}.divide", (6, 3))
            batch = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest(start=pb.MuxStart(id=i, call=small))
                                                              for i in range(1, 201)]))
            assert batch.ByteSize() < 16 << 10
            outgoing = queue.Queue()
            outgoing.put(batch)
            events = []
            with grpc.insecure_channel(server.address) as ch:
                replies = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                           pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120,
                                                                   metadata=(("x-bridge-pool", "q"),))
                reader = threading.Thread(target=lambda: [events.extend(r.events) for r in replies], daemon=True)
                reader.start()
                wait_until(lambda: unread(server)[0] >= 200 * 400, timeout=30, what="the waiting batch counted")
                open_gates([gate])
                holder.done.wait(60)
                outgoing.put(None)
                reader.join(60)
            assert len(events) == 200 and all(e.WhichOneof("kind") == "value" for e in events), events[:3]
            wait_until(lambda: unread(server)[0] == 0, timeout=10, what="nothing held once the batch's calls ended")
    finally:
        server.stop()


def _h2_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_literal(name: bytes, value: bytes) -> bytes:
    assert len(name) < 127 and len(value) < 127
    return b"\x00" + bytes([len(name)]) + name + bytes([len(value)]) + value


def test_unread_describe_replies_count_against_the_bound(server: PoolServer) -> None:
    """A raw HTTP/2 connection that gives itself no window opens thousands of `Describe` calls and never
    reads: their replies (tens of KB each) had not counted in the router's unread bytes, and 5,000 took
    it from 168 to 545 MB. Unary replies of 16 KiB or more count now: the router holds them within
    max_unread_bytes (48 MiB here), and refuses the rest (the bytes the router holds stay within twice
    the bound, not the ~144 MB of the replies)."""
    calls = 3000
    with server.client(pool="p") as c:
        size = len(c.describe().SerializeToString())
    assert size >= 16 * 1024, size      # the catalog's reply is one that counts
    headers = b"".join(_hpack_literal(k, v) for k, v in (
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", b"/vllm_bridge.v1.Bridge/Describe"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"x-bridge-pool", b"p")))
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _h2_frame(4, 0, 0, (4).to_bytes(2, "big") + bytes(4)))
        s.sendall(b"".join(_h2_frame(1, 4, 2 * i + 1, headers) + _h2_frame(0, 1, 2 * i + 1, bytes(5))
                           for i in range(calls)))
        wait_until(lambda: unread(server)[0] > 0, timeout=30, what="the unread Describe replies counted")
        time.sleep(3)
        held = unread(server)[0]
        assert 0 < held <= 2 * 48 * 2**20 < calls * size, held
        assert server.client(pool="p").call(f"{D}.divide", 6, 3, timeout=10) == 2
    wait_until(lambda: unread(server)[0] == 0, timeout=30, what="nothing held once the connection went")


def test_quiet_calls_outlive_client_pings_at_the_documented_interval(server: PoolServer) -> None:
    """Compressed time: this server accepts pings every >= 2 s (min_ping_interval_s = 2; the default
    is 10, `test_the_documented_ping_interval`). A call that receives nothing for 7 s, from a client
    pinging every 2.5 s, lives; a client pinging every second (as often as gRPC lets it) is cut off
    with "too many pings", which shows the policy is what decides."""
    def quiet_call(ping_ms: int) -> grpc.StatusCode:
        gate = Gate()
        options = [("grpc.keepalive_time_ms", ping_ms), ("grpc.keepalive_permit_without_calls", 1),
                   ("grpc.http2.max_pings_without_data", 0)]
        with BridgeClient(server.address, channel_options=options) as c:
            outcome = in_thread(lambda: c.call(*gate.args(), pool="p", timeout=30))
            outcome.done.wait(7)
            open_gates([gate])
            outcome.done.wait(30)
        return grpc.StatusCode.OK if outcome.error is None else outcome.error.code

    assert quiet_call(2500) == grpc.StatusCode.OK
    assert quiet_call(1000) == grpc.StatusCode.UNAVAILABLE


def test_idle_connections_cannot_take_the_servers_open_files(tmp_path: Path) -> None:
    """20,000 connections that sent nothing but HTTP/2's preface took every open file the pool server
    had: no client could connect, and a worker that died could not be started again (334 s). The
    connections a pool server accepts are bounded (`max_connections`; by default its open files less
    a quarter, so the server keeps files of its own): past it a new connection is closed as it comes,
    while clients already connected are served and the pool works on; once they go, anyone connects."""
    server = start_pool_server(tmp_path, 'max_connections = 24\n[[pools]]\nname = "p"\nworkers = 1\n')
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])   # and an empty SETTINGS
    idle: list[socket.socket] = []
    try:
        worker = int(server.pool("p").workers[0].pid)
        with BridgeClient(server.address) as connected:
            assert connected.call(f"{D}.divide", 6, 3, pool="p", timeout=10) == 2
            host, port = server.address.rsplit(":", 1)
            for _ in range(60):
                s = socket.create_connection((host, int(port)), timeout=5)
                s.sendall(preface)
                idle.append(s)
            time.sleep(1.0)
            closed = 0
            for s in idle:
                s.settimeout(0.05)
                try:
                    while data := s.recv(65536):       # the server's SETTINGS, then EOF where it closed
                        del data
                    closed += 1
                except (TimeoutError, socket.timeout):
                    pass
                except OSError:
                    closed += 1
            assert 60 - closed <= 24, f"{60 - closed} idle connections kept open"
            assert connected.call(f"{D}.divide", 8, 2, pool="p", timeout=10) == 4      # still served
            os.killpg(worker, signal.SIGKILL)                                          # and restarted
            time.sleep(0.5)
            wait_until(lambda: _answers(connected), timeout=60, what="the killed worker replaced")
        for s in idle:
            s.close()
        with BridgeClient(server.address) as fresh:
            wait_until(lambda: _answers(fresh), timeout=30, what="a new client served once the idle ones went")
        assert int(server.pool("p").workers[0].pid) != worker
    finally:
        for s in idle:
            s.close()
        server.stop()


def _answers(client: BridgeClient) -> bool:
    try:
        return bool(client.call(f"{D}.divide", 4, 2, pool="p", timeout=3) == 2)
    except CallError:
        return False


def test_the_documented_ping_interval() -> None:
    """The real defaults: servers accept a ping every MIN_PING_INTERVAL_S on an idle connection
    (gRPC's own default punishes any within 5 minutes), so a client pinging every 30 s is fine."""
    from bridge_server.wire.protocol import MIN_PING_INTERVAL_S, server_options
    options = dict(server_options())
    assert options["grpc.http2.min_recv_ping_interval_without_data_ms"] == MIN_PING_INTERVAL_S * 1000 <= 30_000
    assert options["grpc.keepalive_permit_without_calls"] == 1


def test_the_server_keeps_open_files_of_its_own() -> None:
    """Connections may take the pool server's open files less a quarter, at least 1,024 and at most
    half kept back: a worker can always be started (its pipes and sockets need files)."""
    from bridge_server.wire.protocol import connection_limit, public_server_options
    assert [connection_limit(n) for n in (1024, 4096, 20_000)] == [512, 3072, 15_000]
    options = dict(public_server_options(10, connection_limit(20_000)))
    assert options["grpc.max_allowed_incoming_connections"] == 15_000
    assert options["grpc.max_concurrent_streams"] == 4096


def worker_pid(server: PoolServer, pool: str) -> int:
    return int(server.pool(pool).workers[0].pid)


def _fd_target(pid: int, fd: str) -> str:
    """What a process's fd refers to; "" for one it closed since its folder was listed."""
    try:
        return os.readlink(f"/proc/{pid}/fd/{fd}")
    except FileNotFoundError:
        return ""


def shut_down_lane(pid: int, path: str) -> int:
    """Shuts down the worker's end of its lane connections, as a failure would (the socket closes
    under both ends): the worker's fds are duplicated into this process (pidfd_getfd) and shut down."""
    inodes = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]
              if len(line.split()) >= 8 and line.split()[7] == path and line.split()[5] == "03"}
    lanes = {f"socket:[{i}]" for i in inodes}
    fds = [int(fd) for fd in os.listdir(f"/proc/{pid}/fd") if _fd_target(pid, fd) in lanes]
    libc = ctypes.CDLL(None, use_errno=True)
    pidfd = os.pidfd_open(pid)
    try:
        for fd in fds:
            dup = libc.syscall(438, pidfd, fd, 0)     # SYS_pidfd_getfd
            assert dup >= 0, os.strerror(ctypes.get_errno())
            with socket.socket(fileno=dup) as s:
                s.shutdown(socket.SHUT_RDWR)
    finally:
        os.close(pidfd)
    return len(fds)


def test_a_lane_that_fails_is_opened_again(server: PoolServer, client: BridgeClient) -> None:
    worker = server.pool("p").workers[0]
    assert shut_down_lane(worker.pid, lane_path(worker.address.removeprefix("unix:"))) >= 1
    wait_until(lambda: server.pool("p").workers[0].state == "ready", 10, "the lane open again")
    with server.client(pool="p") as c:
        assert c.call(f"{D}.divide", 6, 3, timeout=5) == 2
    assert server.pool("p").workers[0].pid == worker.pid and server.pool("p").restarts == 0
    assert "its lane is open again" in server.log_text()


def test_the_engine_was_warmed_up_before_the_worker_said_serving(server: PoolServer) -> None:
    worker = server.pool("e").workers[0]
    text = (server.log.parent / "logs" / f"{worker.id}.log").read_text(errors="replace")
    assert "engine warmed up" in text and text.index("engine warmed up") < text.index(": serving")


def engine_core(server: PoolServer) -> psutil.Process:
    worker = psutil.Process(worker_pid(server, "e"))
    (core,) = [p for p in worker.children(recursive=True) if "EngineCore" in p.name()]
    return core


def wait_healed(server: PoolServer, replaced: int) -> float:
    t0 = time.monotonic()
    wait_until(lambda: server.pool("e").workers[0].replaced == replaced and server.pool("e").state == "serving",
               90, "the engine replaced")
    return time.monotonic() - t0


def test_a_stopped_engine_core_is_found_dead_and_replaced(server: PoolServer, client: BridgeClient) -> None:
    """An engine that stops answering (here: its core is SIGSTOPped, as a dead input thread looks)
    fails its calls in flight with "engine dead" and the cause, the pool says NOT_SERVING meanwhile,
    and the worker creates the engine again: it serves the same tokens as before, nothing restarted."""
    before = tokens(client, "before-stop")
    core = engine_core(server)
    in_flight = in_thread(lambda: list(client.stream(GENERATE, "Hello", greedy(2000), "wedged", timeout=120)))
    time.sleep(0.5)
    stopped_at = time.monotonic()
    core.send_signal(signal.SIGSTOP)
    # said at once: a stopped core answers nothing (health said SERVING for the probes' ~20 s before)
    wait_until(lambda: health(server, "pool/e") != SERVING, 3, "pool/e NOT_SERVING while the core is stopped")
    assert "is stopped by a signal" in server.pool("e").workers[0].detail, server.pool("e").workers[0]
    in_flight.done.wait(30)
    assert in_flight.error is not None and in_flight.error.code == grpc.StatusCode.UNAVAILABLE, in_flight.error
    assert in_flight.error.reason == "engine dead" and "answered no probe" in in_flight.error.details
    assert in_flight.ended - stopped_at < 15      # probe every 1 s, two unanswered within 4 s
    wait_until(lambda: health(server, "pool/e") != SERVING, 10, "pool/e NOT_SERVING")
    wait_until(lambda: "being created again" in server.pool("e").workers[0].detail, 10, "the detail kept current")
    assert server.pool("e").workers[0].state == "unhealthy"
    with pytest.raises(CallError) as err:
        client.call(f"{D}.divide", 6, 3, timeout=5)      # no worker can serve: at once, saying why
    assert err.value.code == grpc.StatusCode.UNAVAILABLE and "unhealthy" in err.value.details
    healed = wait_healed(server, 1)
    assert tokens(client, "after-stop") == before
    # the stopped core, killed, is collected too (it stayed a zombie for the worker's life)
    wait_until(lambda: not psutil.pid_exists(core.pid), 10, "the old engine core collected")
    assert health(server, "pool/e") == SERVING and server.pool("e").restarts == 0
    print(f"a stopped engine core: found dead and serving again in {time.monotonic() - stopped_at:.1f} s "
          f"({healed:.1f} s after the first check)")


def test_a_killed_engine_core_is_replaced(server: PoolServer, client: BridgeClient) -> None:
    before = tokens(client, "before-kill")
    killed_at = time.monotonic()
    core = engine_core(server)
    core.kill()
    wait_until(lambda: health(server, "pool/e") != SERVING, 10, "pool/e NOT_SERVING")
    wait_healed(server, 2)
    wait_until(lambda: not psutil.pid_exists(core.pid), 10, "the old engine core collected")
    assert tokens(client, "after-kill") == before and server.pool("e").restarts == 0
    print(f"a killed engine core: serving again in {time.monotonic() - killed_at:.1f} s")
