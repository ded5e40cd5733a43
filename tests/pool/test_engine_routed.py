"""End to end: AsyncLLM streams through the pool server, which forwards them over the worker's lane
(`bridge_server/pool/lane.py`): the same items as the worker's own Stream RPC, the lane's window against
a slow reader, and cancellation and deadlines that reach vLLM.

One pool server with one engine worker for the module (an engine costs ~2.7 GB and ~12 s). Every
client is an operator here, since the tests pause the published engine to see it drained.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from bridge_server.client.client import BridgeClient, CallError, Target
from bridge_server.tools.tiny_model import ensure_tiny_model
from tests.pool.harness import PoolServer, start_pool_server, toml_inline, wait_until
from tests.worker.test_engine import (
    LONG,
    assert_patches_decode_like_whole_values,
    assert_same_generations,
    drained,
    engine_args,
    generate_together,
    greedy,
)
from tests.worker.test_engine import wait_until as eventually

GENERATE = Target.method("engine", "generate")


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    tmp = tmp_path_factory.mktemp("routed-engine")
    kwargs = toml_inline({"engine_args": engine_args(ensure_tiny_model())})
    config = f"""
[[pools]]
name = "e"
workers = 1
max_concurrent = 16
log_dir = "{tmp / 'logs'}"
operators = ["*"]
[[pools.objects]]
name = "engine"
target = "vllm.AsyncLLMEngine.from_engine_args"
kwargs = {kwargs}
"""
    server = start_pool_server(tmp, config)
    yield server
    server.stop()


def worker_log(server: PoolServer) -> str:
    worker = server.pool("e").workers[0]
    return (Path(server.log.parent) / "logs" / f"{worker.id}.log").read_text(errors="replace")


def assert_aborted(server: PoolServer, client: BridgeClient, request_id: str) -> None:
    assert eventually(lambda: f"Request {request_id} aborted" in worker_log(server)), \
        f"the engine never aborted {request_id}"
    assert drained(client)
    wait_until(lambda: server.pool("e").in_flight == 0, timeout=5, what="the stream's slot freed")


def test_a_routed_stream_carries_the_same_items_as_the_workers_own_stream(routed: PoolServer) -> None:
    worker = routed.pool("e").workers[0]
    with BridgeClient(routed.address) as via_router, BridgeClient(worker.address) as direct:
        routed_items = list(via_router.stream(GENERATE, "The quick brown fox", greedy(40), "routed-same"))
        direct_items = list(direct.stream(GENERATE, "The quick brown fox", greedy(40), "direct-same"))
    assert len(routed_items) >= 2 and routed_items[-1]["finished"] is True
    # Where items split depends on timing (vLLM merges outputs a consumer has not taken yet); the
    # tokens do not: every item extends the one before, and both end with the same 40.
    tokens = [item["outputs"][0]["token_ids"] for item in routed_items]
    assert all(tokens[i + 1][:len(tokens[i])] == tokens[i] for i in range(len(tokens) - 1))
    assert tokens[-1] == direct_items[-1]["outputs"][0]["token_ids"]
    assert len(tokens[-1]) == 40 and all(type(t) is int for t in tokens[-1])


@pytest.mark.parametrize("way", ["stream", "multiplex", "multiplex-no-window"])
def test_a_slow_reader_through_the_router_gets_merged_items_and_every_token(routed: PoolServer, way: str) -> None:
    """The router lets the worker run at most a window of items ahead of the caller: while the
    reader sleeps, vLLM merges the request's outputs; once it reads again, credit flows and every
    token arrives (a lost credit would stall the stream here). A Multiplex stream runs on the
    client's window and credit, or (window 0) on the router's, credited as replies are written."""
    with BridgeClient(routed.address, channel_options=[("grpc.http2.bdp_probe", 0)]) as client, \
            client.multiplex() as mux:
        # Whole items: the transport's window holds a few of those, but a thousand one-token patches.
        if way == "stream":
            stream = client.stream(GENERATE, "slow reader", greedy(LONG), f"routed-slow-{way}", stream_encoding="full")
        else:
            stream = mux.stream(GENERATE, "slow reader", greedy(LONG), f"routed-slow-{way}",
                                window=0 if way == "multiplex-no-window" else 32, stream_encoding="full")
        assert next(stream)["finished"] is False
        assert drained(client, timeout=120), "the engine never finished"
        rest = list(stream)
    assert rest[-1]["finished"] is True and len(rest[-1]["outputs"][0]["token_ids"]) == LONG
    if way != "multiplex-no-window":
        assert len(rest) < LONG // 10, len(rest)
    # (Without a window the Python client reads everything into its own queue as it comes, as it
    # asked to; the router's window then only has to keep credit flowing, or the stream would stall.)


def test_multiplexed_generations_through_the_router_match_plain_ones(routed: PoolServer) -> None:
    prompts = [f"routed multiplexed prompt {i}" for i in range(6)]
    with BridgeClient(routed.address) as client:
        plain = {p: list(client.stream(GENERATE, p, greedy(24), f"routed-plain-{i}"))[-1]
                 for i, p in enumerate(prompts)}
        with client.multiplex() as mux:
            results = generate_together(mux, prompts, "routed-mux")
            assert mux.call(Target.method("engine", "check_health")) is None
            # A window larger than the router's is the router's to keep: every item still comes.
            wide = list(mux.stream(GENERATE, prompts[0], greedy(24), "routed-wide", window=2**32 - 1,
                                   stream_encoding="full"))
    assert sorted(results) == sorted(prompts)
    assert_same_generations(results, plain)
    assert wide[-1]["outputs"][0]["token_ids"] == plain[prompts[0]]["outputs"][0]["token_ids"]


def test_cancelling_a_multiplexed_stream_through_the_router_aborts_it_and_others_go_on(routed: PoolServer) -> None:
    with BridgeClient(routed.address) as client, client.multiplex() as mux:
        doomed = mux.stream(GENERATE, "cancel me", greedy(LONG), "routed-mux-cancel")
        assert next(doomed)["finished"] is False
        doomed.close()
        assert_aborted(routed, client, "routed-mux-cancel")
        ok = list(mux.stream(GENERATE, "still here", greedy(4), "routed-mux-after"))
        assert ok[-1]["finished"] is True and len(ok[-1]["outputs"][0]["token_ids"]) == 4


def test_cancelling_a_routed_stream_aborts_the_request_in_the_engine(routed: PoolServer) -> None:
    with BridgeClient(routed.address) as client:
        stream = client.stream(GENERATE, "cancel me", greedy(LONG), "routed-cancel")
        assert next(stream)["finished"] is False
        stream.close()
        assert_aborted(routed, client, "routed-cancel")


def test_a_routed_deadline_aborts_the_request_in_the_engine(routed: PoolServer) -> None:
    with BridgeClient(routed.address) as client:
        with pytest.raises(CallError) as err:
            for _ in client.stream(GENERATE, "too slow", greedy(LONG), "routed-deadline", timeout=0.3):
                pass
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert_aborted(routed, client, "routed-deadline")


def test_patched_streams_through_the_router_decode_to_the_same_items_as_whole_ones(routed: PoolServer) -> None:
    """The router passes the encoding option on and the patches through as bytes, for calls of
    their own and for calls of a Multiplex stream."""
    with BridgeClient(routed.address) as client:
        assert_patches_decode_like_whole_values(client, "routed-enc")
        with client.multiplex() as mux:
            assert_patches_decode_like_whole_values(mux, "routed-enc-mux")


def test_a_routed_client_that_does_not_ask_for_patches_gets_whole_values(routed: PoolServer) -> None:
    from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

    with BridgeClient(routed.address) as client:
        request, _ = client.request(GENERATE, ("routed plain items", greedy(8), "routed-plain-items"))
        items = list(pb_grpc.BridgeStub(client.channel).Stream(request))
        patched = list(pb_grpc.BridgeStub(client.channel).Stream(
            request, metadata=[("x-bridge-stream-encoding", "patch-v1")]))
    assert len(items) >= 2 and all(i.HasField("value") and not i.HasField("patch") for i in items)
    assert patched[0].HasField("value") and all(i.HasField("patch") for i in patched[1:])


def test_without_authentication_a_connection_aborts_only_the_requests_it_started(routed: PoolServer) -> None:
    """Without authentication every client's identity is the same (""): a request is the
    connection's that started it. Another connection that names its id ends nothing, and is told
    nothing (a refusal told a stranger which ids were live); the connection
    that started it ends it, whether it started it over Multiplex or with a call of its own, and
    request ids that are not strings are refused by position."""
    abort = Target.method("engine", "abort")
    # (channels of one process share their connections unless told not to: two clients here)
    own = [("grpc.use_local_subchannel_pool", 1)]
    with BridgeClient(routed.address, channel_options=own) as alice, \
            BridgeClient(routed.address, channel_options=own) as bob, alice.multiplex() as mux:
        for attempt in range(3):
            plain = alice.stream(GENERATE, "Once upon a time", {"max_tokens": 2000, "ignore_eos": True},
                                 f"conn-plain-{attempt}")
            muxed = mux.stream(GENERATE, "Once upon a time", {"max_tokens": 2000, "ignore_eos": True},
                               f"conn-mux-{attempt}")
            next(plain), next(muxed)
            tries: list[CallError | None] = []
            for args in ((f"conn-plain-{attempt}",), ([f"conn-mux-{attempt}"],)):
                try:
                    bob.call(abort, *args, timeout=10)
                    tries.append(None)
                except CallError as e:
                    tries.append(e)
            running = [next(plain), next(muxed)]       # bob's aborts ended nothing
            assert alice.call(abort, [f"conn-plain-{attempt}", f"conn-mux-{attempt}"], timeout=10) is None
            ends = [list(plain)[-1], list(muxed)[-1]]
            # Only requests still running when alice aborted them say whether bob's tries were refused.
            if all(end["outputs"][0]["finish_reason"] == "abort" for end in ends):
                break
        else:
            pytest.fail("alice's requests finished on their own three times before they could be aborted")
        assert tries == [None, None], tries
        assert all(not r["finished"] for r in running), running
        with pytest.raises(CallError) as err:
            alice.call(abort, ["conn-plain-0", 5], timeout=10)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "request_id[1]" in err.value.details
        assert "expected a request id (str), got int 5" in err.value.details
