"""End to end: AsyncLLM over gRPC against real vLLM on the tiny local model.

One worker process holds the engines for the whole module (an engine costs ~2.7 GB and ~12 s): a
published LoRA-enabled engine named `engine`, plus the engines the tests create themselves.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
import safetensors.torch
import torch

from bridge_server.client.client import BridgeClient, CallError, Multiplexer, Target
from bridge_server.tools.tiny_model import ensure_tiny_model
from tests.conftest import WorkerProcess, multiplex_clients_leave_blocked, start_worker
from vllm_bridge.v1 import bridge_pb2 as pb

E = "vllm.AsyncLLMEngine"
LONG = 2000   # tokens: seconds of generation, so a test can act on a stream before it ends


MAX_LIVE = 2048     # sequences the shared engine here holds live (the default is 12,288)
COMPILE_S = 3       # how long a grammar may compile here (the default is 10 s)


def engine_args(model: Path, **extra: Any) -> dict[str, Any]:
    return {"model": str(model), "dtype": "float32", "max_model_len": 2048, "enforce_eager": True,
            "max_num_seqs": 16, "enable_log_requests": True, "scheduling_policy": "priority", **extra}


@pytest.fixture(scope="module")
def model() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def engine_worker(tmp_path_factory: pytest.TempPathFactory, model: Path) -> Iterator[WorkerProcess]:
    objects = [{"name": "engine", "target": f"{E}.from_engine_args",
                "kwargs": {"engine_args": engine_args(model, enable_lora=True, max_lora_rank=8)}}]
    # Every caller is an operator here: the tests drive the published engine's controls too.
    tmp = tmp_path_factory.mktemp("engine")
    (tmp / "loras").mkdir()
    w = start_worker(tmp, "--objects", json.dumps(objects), "--operator", "*", "--lora-dir", str(tmp / "loras"),
                     "--max-live-sequences", str(MAX_LIVE), "--grammar-compile-s", str(COMPILE_S), name="engine")
    yield w
    w.stop()


@pytest.fixture()
def bridge(engine_worker: WorkerProcess) -> Iterator[BridgeClient]:
    with BridgeClient(engine_worker.address) as c:
        yield c


def greedy(n: int, **extra: Any) -> dict[str, Any]:
    return {"temperature": 0.0, "max_tokens": n, "ignore_eos": True, **extra}


def generate_together(mux: Multiplexer, prompts: list[str], tag: str) -> dict[str, list[dict[str, Any]]]:
    """Each prompt's items, all generated at once over one Multiplex stream (a thread per prompt)."""
    results: dict[str, list[dict[str, Any]]] = {}

    def one(i: int, prompt: str) -> None:
        results[prompt] = list(mux.stream(Target.method("engine", "generate"), prompt, greedy(24), f"{tag}-{i}"))
    threads = [threading.Thread(target=one, args=(i, p)) for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def assert_same_generations(results: dict[str, list[dict[str, Any]]], plain: dict[str, dict[str, Any]]) -> None:
    """Every stream ended once, with the tokens of the same prompt generated on its own."""
    for p, items in results.items():
        assert items[-1]["finished"] is True and [i["finished"] for i in items[:-1]] == [False] * (len(items) - 1)
        assert items[-1]["outputs"][0]["token_ids"] == plain[p]["outputs"][0]["token_ids"]


def engine_processes(worker: WorkerProcess) -> set[int]:
    """The worker's live engine-core processes (one that exits while being looked at is not)."""
    live = set()
    for p in psutil.Process(worker.proc.pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(p.cmdline() + [p.name()]):
                live.add(p.pid)
        except (psutil.ZombieProcess, psutil.NoSuchProcess):
            pass
    return live


def drained(client: BridgeClient, engine: Any = "engine", timeout: float = 10.0) -> bool:
    """Whether the engine finishes every request it has within `timeout`, seen through the documented
    surface: pausing it with wait_for_inflight_requests waits for exactly that."""
    try:
        client.call(Target.method(engine, "pause_generation"),
                    kwargs={"wait_for_inflight_requests": True, "clear_cache": False}, timeout=timeout)
    except CallError as err:
        if err.code == grpc.StatusCode.DEADLINE_EXCEEDED:
            return False
        raise
    finally:
        client.call(Target.method(engine, "resume_generation"), timeout=30)
    return True


def wait_until(predicate: Any, timeout: float = 10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def assert_aborted_in_engine(worker: WorkerProcess, client: BridgeClient, request_id: str) -> None:
    """The engine itself says the request was aborted, and nothing of it is left running."""
    assert wait_until(lambda: f"Request {request_id} aborted" in worker.log.read_text()), \
        f"the engine never aborted {request_id}"
    assert drained(client)


def in_process_token_ids(model: Path, prompt: str, n: int) -> list[int]:
    """The same request on an in-process AsyncLLM, as the reference."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    async def run() -> list[int]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args(model, enable_lora=True, max_lora_rank=8)))
        try:
            last = None
            async for out in engine.generate(prompt, SamplingParams(**greedy(n)), "reference"):
                last = out
            assert last is not None
            return list(last.outputs[0].token_ids)
        finally:
            engine.shutdown()

    return asyncio.run(run())


def test_the_first_randomly_sampled_request_finds_the_sampler_compiled(bridge: BridgeClient) -> None:
    """The first test of this module's engine, on purpose: vLLM compiles its random sampler at the
    first unseeded sampled request, in the engine core, and every stream of the engine stood still
    for it (5-7 s). The worker's warm-up samples one, so no client pays for it. (4 tokens take ~0.05 s.)"""
    started = time.monotonic()
    items = list(bridge.stream(GENERATE, "the first sampled one", {"temperature": 0.9, "max_tokens": 4,
                                                                  "ignore_eos": True}, "first-sampled"))
    took = time.monotonic() - started
    assert items[-1]["finished"] is True and len(items[-1]["outputs"][0]["token_ids"]) == 4
    assert took < 2.5, f"the first sampled request took {took:.1f} s: the sampler was compiled on its time"


def test_generate_streams_the_same_tokens_as_in_process_vllm(bridge: BridgeClient, model: Path) -> None:
    items = list(bridge.stream(Target.method("engine", "generate"), "The quick brown fox", greedy(24), "same-1"))
    assert len(items) >= 2                       # streamed, not one reply at the end
    last = items[-1]
    assert last["request_id"] == "same-1" and last["finished"] is True
    out = last["outputs"][0]
    assert out["finish_reason"] == "length" and len(out["token_ids"]) == 24
    assert all(type(t) is int for t in out["token_ids"])
    assert out["token_ids"] == in_process_token_ids(model, "The quick brown fox", 24)
    # vLLM's per-request stats are there (the worker only stops recording Prometheus metrics it never serves)
    stats = last["metrics"]
    assert stats["num_generation_tokens"] == 24 and 0 < stats["first_token_ts"] <= stats["last_token_ts"]


def test_a_stream_interval_coalesces_items_without_losing_tokens(bridge: BridgeClient) -> None:
    every = list(bridge.stream(Target.method("engine", "generate"), "coalesce", greedy(64), "every"))
    coalesced = list(bridge.stream(Target.method("engine", "generate"), "coalesce", greedy(64), "coalesced",
                                   stream_interval_s=0.05))
    assert len(coalesced) < len(every) and len(coalesced) >= 1
    assert coalesced[-1]["outputs"][0]["token_ids"] == every[-1]["outputs"][0]["token_ids"]
    assert coalesced[-1]["finished"] is True
    # With DELTA outputs (the enum member travels as a typed enum value) the pieces still add up to
    # every token exactly once.
    from vllm.sampling_params import RequestOutputKind
    deltas = list(bridge.stream(Target.method("engine", "generate"), "coalesce",
                                greedy(64, output_kind=RequestOutputKind.DELTA), "coalesced-delta",
                                stream_interval_s=0.05))
    assert len(deltas) < 64
    assert sum((d["outputs"][0]["token_ids"] for d in deltas), []) == every[-1]["outputs"][0]["token_ids"]


def test_concurrent_generations_share_the_engine(bridge: BridgeClient) -> None:
    results: dict[int, list[int]] = {}

    def one(i: int) -> None:
        items = list(bridge.stream(Target.method("engine", "generate"), f"prompt number {i}", greedy(32), f"cc-{i}"))
        results[i] = items[-1]["outputs"][0]["token_ids"]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(results) == list(range(8)) and all(len(ids) == 32 for ids in results.values())


def test_client_cancel_aborts_the_request_in_the_engine(bridge: BridgeClient, engine_worker: WorkerProcess) -> None:
    stream = bridge.stream(Target.method("engine", "generate"), "cancel me", greedy(LONG), "cancel-client")
    first = next(stream)
    assert first["finished"] is False
    stream.close()     # cancels the gRPC call
    assert_aborted_in_engine(engine_worker, bridge, "cancel-client")


def test_deadline_aborts_the_request_in_the_engine(bridge: BridgeClient, engine_worker: WorkerProcess) -> None:
    with pytest.raises(CallError) as err:
        for _ in bridge.stream(Target.method("engine", "generate"), "too slow", greedy(LONG), "cancel-deadline",
                               timeout=0.15):
            pass
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_aborted_in_engine(engine_worker, bridge, "cancel-deadline")


@pytest.mark.parametrize("interval_s", [0.05, 10.0], ids=["items-always-ready", "pausing-past-it"])
@pytest.mark.parametrize("way", ["stream", "multiplex"])
def test_a_deadline_holds_when_every_item_is_ready_before_it_is_asked_for(
        bridge: BridgeClient, engine_worker: WorkerProcess, way: str, interval_s: float) -> None:
    """Coalescing (or a reader slower than the engine) means the next item is always waiting when the
    stream asks for it: the stream never waits, yet its deadline passes all the same. It ends the
    stream on time, with DEADLINE_EXCEEDED, and aborts the request (a Multiplex call has no gRPC
    deadline of its own: the worker's is the only one). A coalescing pause longer than the time left
    ends at the deadline, not 10 s later."""
    request_id = f"ready-deadline-{way}-{interval_s}"
    received = []
    t0 = time.monotonic()
    with bridge.multiplex() as mux, pytest.raises(CallError) as err:
        source = mux if way == "multiplex" else bridge
        for item in source.stream(Target.method("engine", "generate"), "always ready", greedy(LONG), request_id,
                                  timeout=0.5, stream_interval_s=interval_s):
            received.append(item)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value.details
    assert received and not received[-1]["finished"]
    assert time.monotonic() - t0 < interval_s / 2 + 2.0
    assert_aborted_in_engine(engine_worker, bridge, request_id)


def test_the_tighter_of_the_grpc_deadline_and_the_timeout_option_holds(bridge: BridgeClient,
                                                                       engine_worker: WorkerProcess) -> None:
    """A gRPC deadline of a minute and `x-bridge-timeout-ms` of half a second: the stream ends at the
    half second, as it does through a pool (whose router and worker both take the tighter one)."""
    t0 = time.monotonic()
    with pytest.raises(CallError) as err:
        for _ in bridge.stream(Target.method("engine", "generate"), "two deadlines", greedy(LONG), "two-deadlines",
                               timeout=60, timeout_s=0.5):
            pass
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - t0 < 10
    assert_aborted_in_engine(engine_worker, bridge, "two-deadlines")


def test_a_multiplexed_deadline_holds_while_the_stream_waits_for_its_reader(bridge: BridgeClient,
                                                                            engine_worker: WorkerProcess) -> None:
    """The reader takes one item and then reads nothing past the call's deadline: the worker, waiting
    for credit, ends the call at its deadline, not at the far later reader_stall_s."""
    with bridge.multiplex() as mux:
        stream = mux.stream(Target.method("engine", "generate"), "unread", greedy(LONG), "unread-deadline",
                            timeout=1.0, window=1)
        assert next(stream)["finished"] is False
        time.sleep(2.0)
        with pytest.raises(CallError) as err:
            list(stream)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "waiting for the caller to read" in err.value.details, err.value.details
    assert_aborted_in_engine(engine_worker, bridge, "unread-deadline")


def test_multiplex_clients_that_go_away_with_their_writes_blocked_end_their_calls_at_once(
        engine_worker: WorkerProcess, bridge: BridgeClient) -> None:
    """Clients credit their calls on the worker's own Multiplex, read nothing, start more, then
    cancel and close: every call ends in the engine at once, not when the worker gives up waiting for
    credit (reader_stall_s, 60 s here). Without the handler's cleanup the calls ran on, holding engine
    seats. (The pool server's cleanup was cut short by gRPC's second cancel; the worker's handler
    is closed rather than cancelled, and it cancels its calls before any wait all the same.)"""
    def start(c: int, i: int) -> pb.CallRequest:
        prompt = "stop reading " * 100 if i < 5 else "more"
        return bridge.request(Target.method("engine", "generate"), (prompt, greedy(1500), f"worker-gone-{c}-{i}"))[0]
    # every write blocked after 3 s: 64 KiB is a few items of these
    multiplex_clients_leave_blocked(engine_worker.address, (("x-bridge-stream-encoding", "full"),), 3, start,
                                    lambda: time.sleep(3.0))
    assert drained(bridge, timeout=5), "the calls of clients that left ran on"
    for c in range(3):
        for i in range(1, 5):
            assert f"Request worker-gone-{c}-{i} aborted" in engine_worker.log.read_text()


def test_stream_idle_timeout_aborts_the_request_in_the_engine(bridge: BridgeClient,
                                                              engine_worker: WorkerProcess) -> None:
    received = []
    with pytest.raises(CallError) as err:
        for item in bridge.stream(Target.method("engine", "generate"), "idle", greedy(LONG), "cancel-idle",
                                  stream_timeout_s=0.001):
            received.append(item)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert "waiting for the next item" in err.value.details
    assert received and not received[-1]["finished"]
    assert_aborted_in_engine(engine_worker, bridge, "cancel-idle")


def test_abort_from_a_second_call_ends_the_stream_with_finish_reason_abort(bridge: BridgeClient) -> None:
    """The abort is the same client's, over its connection: without authentication a request is its
    connection's to end. (A second BridgeClient in this process shared the connection only as long as
    gRPC's global subchannel pool happened to give it the same one: this test failed once in CI so.)"""
    stream = bridge.stream(Target.method("engine", "generate"), "abort me", greedy(LONG), "to-abort")
    next(stream)
    assert bridge.call(Target.method("engine", "abort"), "to-abort") is None
    rest = list(stream)
    assert rest and rest[-1]["outputs"][0]["finish_reason"] == "abort"
    assert len(rest[-1]["outputs"][0]["token_ids"]) < LONG
    assert drained(bridge)


def test_tokenizer_ref_encodes_like_the_engine(bridge: BridgeClient) -> None:
    tokenizer = bridge.call(Target.method("engine", "get_tokenizer"))
    ids = bridge.call(Target.method(tokenizer, "encode"), "Hello world")
    items = list(bridge.stream(Target.method("engine", "generate"), "Hello world", greedy(1), "tok-1"))
    assert ids == items[-1]["prompt_token_ids"]
    assert bridge.call(Target.method(tokenizer, "decode"), ids[1:]) == "Hello world"


def test_tokenizer_decode_gives_the_library_s_own_text(bridge: BridgeClient, model: Path) -> None:
    """The worker decodes outside the interpreter's lock (the tokenizer's batch decoding), so a
    decode of a million ids does not stop its other calls; the text is the library's `decode`'s,
    for every option, special tokens, spaces to clean up, and the cases it leaves to `decode`."""
    import random

    from transformers import AutoTokenizer
    local = AutoTokenizer.from_pretrained(model)
    tokenizer = bridge.call(Target.method("engine", "get_tokenizer"))
    rng = random.Random(7)
    cases: list[Any] = [
        local.encode("Hello world , it 's   a test ! 'll n't"),
        [rng.randrange(local.vocab_size) for _ in range(2_000)],
        [*local.all_special_ids, 5, 6, *local.all_special_ids],
        [],
    ]
    for ids in cases:
        for options in ({}, {"skip_special_tokens": True}, {"clean_up_tokenization_spaces": True},
                        {"clean_up_tokenization_spaces": False, "skip_special_tokens": True}):
            assert bridge.call(Target.method(tokenizer, "decode"), ids, kwargs=options) == \
                local.decode(ids, **options), (ids[:10], options)
    assert bridge.call(Target.method(tokenizer, "decode"), 7) == local.decode(7)           # left to decode
    # options past these the library passes to its own `_decode`, which ignores what it does not know
    for options in ({"use_source_tokenizer": False}, {"no_such_option": 1}):
        with pytest.raises(CallError) as err:
            bridge.call(Target.method(tokenizer, "decode"), cases[0], kwargs=options)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "not an option this server passes on" in err.value.details and err.value.detail is not None
        assert err.value.detail.parameter == repr(next(iter(options))), err.value.detail
    with pytest.raises(CallError) as err:
        bridge.call(Target.method(tokenizer, "decode"), cases[0], kwargs={"skip_special_tokens": "yes"})
    assert err.value.detail is not None and err.value.detail.parameter == "skip_special_tokens", err.value


def test_no_call_changes_the_shared_tokenizer_and_truncation_matches_the_library(
        engine_worker: WorkerProcess, bridge: BridgeClient, model: Path) -> None:
    """A fast tokenizer keeps truncation and padding settings in the Rust tokenizer every request of
    the engine shares: a call asking for others changed them, and other threads using it at that
    moment (vLLM detokenizing every stream) failed with "Already borrowed"; a padding to 10**8 took
    12.9 GB. Truncations are now made on the encoding, ids as the library's own; padding and the
    other options are refused by name; decode names an id outside the vocabulary."""
    import concurrent.futures

    from transformers import AutoTokenizer
    local = AutoTokenizer.from_pretrained(model)
    # The engine's documented `tokenizer` attribute, called as a METHOD, ran the tokenizer's own __call__
    # with any options (padding to 10**7: +1.2 GB; other clients' streams "Already borrowed")
    with pytest.raises(CallError) as err:
        bridge.call(Target.method("engine", "tokenizer"), "hi", kwargs={"padding": "max_length", "max_length": 10**7})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "tokenizer is an attribute (a " in err.value.details
    assert "not a method: read it with GET_ATTR" in err.value.details, err.value
    with pytest.raises(CallError) as err:      # nor its __call__ on a ref to it
        bridge.call(Target.method(bridge.call(Target.get("engine", "tokenizer")), "__call__"), "hi")
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, err.value
    tokenizer = bridge.call(Target.method("engine", "get_tokenizer"))
    encode = Target.method(tokenizer, "encode")
    text = "Once upon a time there was a tokenizer that everyone shared " * 3
    for side in ("left", "right"):
        local.truncation_side = side
        for add in (True, False):
            for max_length in (1, 2, 7, 1000):
                want = local.encode(text, add_special_tokens=add, truncation=True, max_length=max_length)
                if side == "right":      # the engine's tokenizer truncates on the left (vLLM's, generating)
                    continue
                assert bridge.call(encode, text, kwargs={"add_special_tokens": add, "truncation": True,
                                                         "max_length": max_length}) == want, (add, max_length)
    local.truncation_side = "left"
    items = list(bridge.stream(GENERATE, text, {**greedy(2), "truncate_prompt_tokens": 5}, "truncated"))
    assert items[-1]["prompt_token_ids"] == local.encode(text, truncation=True, max_length=5)
    for options, name in (({"padding": "max_length", "max_length": 100_000_000}, "padding"),
                          ({"return_tensors": "pt"}, "return_tensors"), ({"stride": 2}, "stride"),
                          ({"is_split_into_words": True}, "is_split_into_words")):
        with pytest.raises(CallError) as err:
            bridge.call(encode, "hi", kwargs=options)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "parameter" in err.value.details and name in err.value.details and "not an option" in err.value.details
    import torch
    for ids, where in (([5, -1], "token_ids[1]"), (torch.tensor([1, 2**40]), "token_ids[1]"),
                       ("abc", "token_ids: expected a token id or a list of them, got str")):
        with pytest.raises(CallError) as err:
            bridge.call(Target.method(tokenizer, "decode"), ids)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and f"parameter {where}" in err.value.details, err
    assert bridge.call(Target.method(tokenizer, "decode"), torch.tensor([5, 6])) == local.decode([5, 6])
    with pytest.raises(CallError) as err:
        bridge.call(encode, "hi", kwargs={"truncation": True, "max_length": 2**100})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "parameter max_length" in err.value.details, err
    # Truncating encodes and requests in a loop beside plain streams: every stream ends well.
    stop = time.monotonic() + 4

    def truncating(i: int) -> int:
        n = 0
        with BridgeClient(engine_worker.address) as c:
            while time.monotonic() < stop:
                c.call(encode, text, kwargs={"truncation": True, "max_length": 3 + n % 5})
                if i == 0:
                    list(c.stream(GENERATE, text, {**greedy(1), "truncate_prompt_tokens": 4}, f"trunc-{n}"))
                n += 1
        return n
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        loops = [pool.submit(truncating, i) for i in range(3)]
        streams = 0
        while time.monotonic() < stop:
            items = list(bridge.stream(GENERATE, "Hello", greedy(8), f"beside-truncating-{streams}"))
            assert items[-1]["finished"] and len(items[-1]["outputs"][0]["token_ids"]) == 8
            streams += 1
        assert all(f.result() > 0 for f in loops) and streams > 0


def test_a_long_truncated_text_holds_up_no_other_client_s_request(engine_worker: WorkerProcess, model: Path) -> None:
    """A text of a million characters truncated to a few tokens is encoded whole, as vLLM does: about
    two seconds here. Such encodings take their turns on a thread of their own, so another client's
    request that the engine also builds off its loop (one with `bad_words`) waits behind none of
    them. It used to wait behind each one already running on the one thread every such request
    shared."""
    import concurrent.futures

    from transformers import AutoTokenizer
    text = "\u4e00\u4e8c" * 490_000
    local = AutoTokenizer.from_pretrained(model, truncation_side="left")
    done: dict[str, float] = {}

    def run(name: str, prompt: str, params: dict[str, Any]) -> list[int]:
        with BridgeClient(engine_worker.address) as c:
            items = list(c.stream(GENERATE, prompt, params, name, timeout=120))
        done[name] = time.monotonic()
        assert items[-1]["finished"], name
        return list(items[-1]["prompt_token_ids"])
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        long = [pool.submit(run, f"long-truncated-{i}", text, {**greedy(1), "truncate_prompt_tokens": 4})
                for i in range(2)]
        time.sleep(0.5)          # the first one's text is being encoded
        beside = pool.submit(run, "beside-long-truncated", "Hello", greedy(1, bad_words=["xyz"]))
        assert beside.result(60)
        kept = [f.result(120) for f in long]
    assert kept[0] == kept[1] == local.encode(text, truncation=True, max_length=4)
    assert done["beside-long-truncated"] < min(done["long-truncated-0"], done["long-truncated-1"]), done


def test_engine_control_methods(bridge: BridgeClient) -> None:
    assert bridge.call(Target.method("engine", "check_health")) is None
    assert bridge.call(Target.method("engine", "get_supported_tasks")) == ("generate",)
    assert bridge.call(Target.method("engine", "is_paused")) is False
    bridge.call(Target.method("engine", "pause_generation"))
    assert bridge.call(Target.method("engine", "is_paused")) is True
    bridge.call(Target.method("engine", "resume_generation"))
    assert bridge.call(Target.method("engine", "is_paused")) is False
    assert bridge.call(Target.method("engine", "reset_prefix_cache")) is True
    assert bridge.call(Target.get("engine", "errored")) is False
    assert bridge.call(Target.get("engine", "is_running")) is True
    assert bridge.call(Target.method("engine", "is_sleeping")) is False
    with pytest.raises(CallError) as err:     # CPU vLLM has no profiler configured: vLLM's own error
        bridge.call(Target.method("engine", "start_profile"))
    # the engine core sends only the text of its failure: the engine's state, said without vLLM's wrapper
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.category == "engine", err.value
    assert "Profiler is not enabled" in err.value.details and "Call to" not in err.value.details, err.value
    for bad in (-1, 0, 2**70, True):
        with pytest.raises(CallError) as err:
            bridge.call(Target.method("engine", "remove_lora"), bad)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "lora_id", err.value
    for level in (3, 2**70):     # refused in the core only, after the engine was counted asleep here
        with pytest.raises(CallError) as err:
            bridge.call(Target.method("engine", "sleep"), level)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "level", err.value
    assert bridge.call(Target.method("engine", "is_sleeping")) is False
    assert list(bridge.stream(Target.method("engine", "generate"), "awake", greedy(2), "after-sleep"))[-1]["finished"]


def test_lora_adapters_load_pin_generate_and_unload(bridge: BridgeClient, model: Path,
                                                    engine_worker: WorkerProcess) -> None:
    lora = {"lora_name": "tiny", "lora_int_id": 1, "lora_path": str(model / "lora")}
    assert bridge.call(Target.method("engine", "add_lora"), lora) is True
    assert bridge.call(Target.method("engine", "list_loras")) == {1}
    assert bridge.call(Target.method("engine", "pin_lora"), 1) is True
    base = list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(16), "lora-base"))
    with_lora = list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(16), "lora-on",
                                   kwargs={"lora_request": lora}))
    assert with_lora[-1]["outputs"][0]["token_ids"] != base[-1]["outputs"][0]["token_ids"]
    # ... and by its name alone: two requests of one name under two ids in one step killed the engine
    # core (one id never activated). A name is bound with its id, both ways.
    for named, says in (({**lora, "lora_int_id": 2}, "bound to another LoRA id on this engine (1)"),
                        ({**lora, "lora_name": "tiny-again"}, "LoRA id 1 is bound to another name")):
        for call in (lambda: list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(4),
                                                "lora-name", kwargs={"lora_request": named})),
                     lambda: bridge.call(Target.method("engine", "add_lora"), named)):
            with pytest.raises(CallError) as err:
                call()
            assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.reason == "lora name in use", err.value
            assert err.value.detail.parameter == "lora_request.lora_name" and says in err.value.details, err.value
    assert bridge.call(Target.method("engine", "list_loras")) == {1}
    # vLLM knows an adapter by its id alone: a request (or an add) under id 1 with another path ran with
    # adapter 1's weights, or after an eviction loaded the other path for every client of id 1
    other = {**lora, "lora_path": str(model / "lora-of-another-client")}
    with pytest.raises(CallError) as err:
        list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(4), "lora-other",
                           kwargs={"lora_request": other}))
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS and err.value.reason == "lora id in use", err.value
    assert err.value.detail.parameter == "lora_request.lora_int_id", err.value
    with pytest.raises(CallError) as err:
        bridge.call(Target.method("engine", "add_lora"), other)
    assert err.value.code == grpc.StatusCode.ALREADY_EXISTS, err.value
    assert bridge.call(Target.method("engine", "remove_lora"), 1) is True
    assert bridge.call(Target.method("engine", "list_loras")) == set()
    # vLLM loads a request's adapter in the engine core, where failing to killed it under every client's
    # requests: a new id's adapter is loaded first, and a path with none is refused by name. Id 1 is
    # free again after its removal, so this is about the path, not the id.
    for lora_id in (1, 2):
        with pytest.raises(CallError) as err:
            list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(4), f"lora-none-{lora_id}",
                               kwargs={"lora_request": {**other, "lora_int_id": lora_id}}))
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.reason == "lora not loaded", err.value
        assert err.value.detail.parameter == "lora_request.lora_path", err.value
        assert "No adapter found" in err.value.details and "Call to" not in err.value.details, err.value.details
    with pytest.raises(CallError) as err:
        bridge.call(Target.method("engine", "add_lora"), {**other, "lora_int_id": 3})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.reason == "lora not loaded", err.value
    for bad_id in (2**70, -5):
        with pytest.raises(CallError) as err:
            bridge.call(Target.method("engine", "add_lora"), {**lora, "lora_int_id": bad_id})
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.detail.parameter == "lora_request.lora_int_id", err.value
    # a bound name is kept for the engine's life: one of a million characters is refused, not kept
    for field, long in (("lora_name", "n" * 257), ("lora_path", str(model / "lora" / ("p" * 4096)))):
        for attempt in (lambda r: bridge.call(Target.method("engine", "add_lora"), r),
                        lambda r: list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(4),
                                                     "lora-long", kwargs={"lora_request": r}))):
            with pytest.raises(CallError) as err:
                attempt({**lora, "lora_int_id": 9, field: long})
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert err.value.detail.parameter == f"lora_request.{field}", err.value
            assert f"at most {256 if field == 'lora_name' else 4096:,} characters, got {len(long):,}" \
                in err.value.details, err.value
    assert 9 not in bridge.call(Target.method("engine", "list_loras"))
    assert bridge.call(Target.get("engine", "errored")) is False
    # vLLM keeps an id whose adapter it registered and then failed to activate (a module of the wrong
    # shape): the next request under that id, with another path, ran the failed adapter's weights
    broken = engine_worker.log.parent / "loras" / "broken"
    shutil.copytree(model / "lora", broken)
    tensors = safetensors.torch.load_file(str(broken / "adapter_model.safetensors"))
    for key in [k for k in tensors if "layers.1.self_attn.v_proj" in k]:
        tensors[key] = torch.cat([tensors[key]] * 2, dim=1 if "lora_A" in key else 0) * 50
    safetensors.torch.save_file(tensors, str(broken / "adapter_model.safetensors"))
    with pytest.raises(CallError) as err:
        bridge.call(Target.method("engine", "add_lora"), {**lora, "lora_int_id": 7, "lora_path": str(broken)})
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.reason == "lora not loaded", err.value
    assert 7 not in bridge.call(Target.method("engine", "list_loras"))
    again = list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(16), "lora-after-broken",
                               kwargs={"lora_request": {**lora, "lora_int_id": 7}}))
    assert again[-1]["outputs"][0]["token_ids"] == with_lora[-1]["outputs"][0]["token_ids"]
    assert bridge.call(Target.method("engine", "remove_lora"), 7) is True
    assert list(bridge.stream(Target.method("engine", "generate"), "Once upon", greedy(4), "lora-first-use",
                              kwargs={"lora_request": {**lora, "lora_int_id": 4}}))[-1]["finished"]
    assert bridge.call(Target.method("engine", "list_loras")) == {4}      # loaded before the request ran
    assert bridge.call(Target.method("engine", "remove_lora"), 4) is True


def test_encode_with_an_unsupported_task_is_refused_and_the_engine_lives(bridge: BridgeClient) -> None:
    with pytest.raises(CallError) as err:
        list(bridge.stream(Target.method("engine", "encode"), "embed me", {"task": "embed"}, "enc-1"))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "supported tasks: generate" in err.value.details and err.value.reason == "unsupported task"
    with pytest.raises(CallError):
        list(bridge.stream(Target.method("engine", "encode"), "embed me", {}, "enc-2"))   # task None
    assert bridge.call(Target.method("engine", "check_health")) is None
    assert bridge.call(Target.get("engine", "errored")) is False
    assert list(bridge.stream(Target.method("engine", "generate"), "still alive", greedy(2), "alive"))[-1]["finished"]


def test_engine_args_vllm_refuses_are_refused_by_argument_before_any_engine_starts(
        bridge: BridgeClient, model: Path, engine_worker: WorkerProcess) -> None:
    """vLLM's config checks raised a bare RuntimeError (FP8 KV cache on the CPU: UNKNOWN) or pydantic's
    dump of every input, naming no argument, or one the client never sent; and a tokenizer that does
    not load, a bare ValueError from the engine's construction."""
    before = engine_processes(engine_worker)
    for extra, where, says in (({"kv_cache_dtype": "fp8"}, "engine_args", "FP8 KV cache"),
                               ({"max_num_seqs": 0}, "engine_args.max_num_seqs", "greater than or equal to 1, got 0"),
                               ({"max_model_len": 10**6}, "engine_args.max_model_len", "max_model_len")):
        with pytest.raises(CallError) as err:
            bridge.call(f"{E}.from_engine_args", engine_args(model, **extra), timeout=120)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.detail is not None and err.value.detail.parameter == where, err.value
        assert f"parameter {where}: vLLM refused the configuration" in err.value.details, err.value
        assert says in err.value.details and "input_value" not in err.value.details, err.value
    # a tokenizer that does not load failed the engine's construction with a bare ValueError; one that
    # is not there, the engine args' own construction, named as the whole map
    for extra, where, says in (({"tokenizer_mode": "mistral"}, "engine_args.tokenizer_mode",
                                "vLLM could not load the engine's tokenizer: ValueError: No tokenizer file found"),
                               ({"tokenizer": str(model / "none-here")}, "engine_args.tokenizer",
                                "cannot build AsyncEngineArgs from the map given: HFValidationError")):
        with pytest.raises(CallError) as err:
            bridge.call(f"{E}.from_engine_args", engine_args(model, **extra), timeout=120)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert err.value.detail is not None and err.value.detail.parameter == where, err.value
        assert f"parameter {where}: {says}" in err.value.details, err.value
    assert engine_processes(engine_worker) == before


def test_an_engine_whose_core_does_not_start_is_refused_with_the_cores_reason(
        bridge: BridgeClient, model: Path, engine_worker: WorkerProcess) -> None:
    """Arguments the configuration's checks pass can still fail in the engine core, where the model
    loads: the worker got vLLM's "Engine core initialization failed. See root cause above" (UNKNOWN,
    no parameter), and the reason was only in the server's log. The core now tells its worker."""
    before = engine_processes(engine_worker)
    with pytest.raises(CallError) as err:
        bridge.call(f"{E}.from_engine_args", engine_args(model, quantization="bitsandbytes"), timeout=120)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert err.value.detail is not None and err.value.detail.parameter == "engine_args.quantization", err.value
    assert "vLLM's engine core did not start with these engine_args (set besides the model:" in err.value.details
    assert "ImportError: Please install bitsandbytes" in err.value.details, err.value
    assert wait_until(lambda: engine_processes(engine_worker) == before)
    with pytest.raises(CallError) as err:     # a bare assert in the core: the check it tripped, where
        bridge.call(f"{E}.from_engine_args", engine_args(model, convert="embed"), timeout=120)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION, err.value
    assert re.search(r"AssertionError: with no message, at \w+\.py:\d+: assert \w+", err.value.details), err.value
    # the core's report, read, is gone with its folder (a worker leaves none behind)
    assert not Path(tempfile.gettempdir(), f"vllm-bridge-cores-{engine_worker.proc.pid}").exists()
    assert bridge.call(Target.method("engine", "check_health")) is None
    assert list(bridge.stream(Target.method("engine", "generate"), "still", greedy(2), "after-core"))[-1]["finished"]


def test_an_engine_built_from_a_map_generates_and_shutdown_leaves_no_process(bridge: BridgeClient, model: Path,
                                                                             engine_worker: WorkerProcess) -> None:
    before = engine_processes(engine_worker)
    stdout = os.readlink(f"/proc/{engine_worker.proc.pid}/fd/1")
    quiet = bridge.call("vllm.distributed.suppress_stdout")      # a client's suppression, held meanwhile:
    bridge.call(Target.method(quiet, "__enter__"))               # the core still gets the worker's output
    try:
        engine = bridge.call(f"{E}.from_engine_args", engine_args(model), timeout_profile="ml_inference")
        assert os.readlink(f"/proc/{engine_worker.proc.pid}/fd/1") == "/dev/null"    # still suppressed
    finally:
        bridge.release(quiet)
    assert engine.type_name == "vllm.v1.engine.async_llm.AsyncLLM"
    started = engine_processes(engine_worker) - before
    assert len(started) == 1
    assert os.readlink(f"/proc/{next(iter(started))}/fd/1") == stdout, "the core's log goes to /dev/null"
    items = list(bridge.stream(Target.method(engine, "generate"), "from a map", greedy(8), "map-1"))
    assert len(items[-1]["outputs"][0]["token_ids"]) == 8
    # drained at once (nothing runs); a drain timeout of 0 was vLLM's TimeoutError, told as the call's deadline
    assert bridge.call(Target.method(engine, "wait_for_requests_to_drain"), 5) is None
    with pytest.raises(CallError) as err:
        bridge.call(Target.method(engine, "wait_for_requests_to_drain"), 0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "drain_timeout", \
        err.value
    assert bridge.call(Target.method(engine, "shutdown")) is None
    assert wait_until(lambda: not (engine_processes(engine_worker) & started))


def test_an_engine_from_a_configuration_without_a_model_is_refused_by_name(bridge: BridgeClient) -> None:
    config = bridge.call("vllm.config.VllmConfig")      # every default: no model
    with pytest.raises(CallError) as err:
        bridge.call(f"{E}.from_vllm_config", config)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value     # was UNKNOWN: an AttributeError on None
    assert err.value.detail.parameter == "vllm_config.model_config", err.value


def test_streaming_what_returns_a_ref_is_refused_before_it_is_made(bridge: BridgeClient, model: Path,
                                                                   engine_worker: WorkerProcess) -> None:
    """Stream of from_engine_args built an engine for 17 s, then said to use Call."""
    before = engine_processes(engine_worker)
    t0 = time.monotonic()
    with pytest.raises(CallError) as err:
        list(bridge.stream(f"{E}.from_engine_args", engine_args(model), timeout=60))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "use Call" in err.value.details, err.value
    assert time.monotonic() - t0 < 5 and engine_processes(engine_worker) == before


def test_an_engine_that_takes_no_text_or_only_a_few_tokens_is_made(bridge: BridgeClient, model: Path,
                                                                    engine_worker: WorkerProcess) -> None:
    """The worker warms every engine up before its maker gets it; its warm-up sent text of 8
    tokens, so an engine made with skip_tokenizer_init (which takes no text), or with a
    max_model_len under 12, took its 17 s to start and then failed as INTERNAL."""
    before = engine_processes(engine_worker)
    engine = bridge.call(f"{E}.from_engine_args", engine_args(model, skip_tokenizer_init=True, max_model_len=3),
                         timeout_profile="ml_inference")
    try:
        items = list(bridge.stream(Target.method(engine, "generate"), {"prompt_token_ids": [5, 6]}, greedy(1),
                                   "few-tokens"))
        assert len(items[-1]["outputs"][0]["token_ids"]) == 1
        for text in ("hi", {"prompt": "hi"}):     # vLLM's bare ValueError named no parameter
            with pytest.raises(CallError) as err:
                list(bridge.stream(Target.method(engine, "generate"), text, greedy(1), "text-without-tokenizer"))
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
            assert err.value.detail is not None and err.value.detail.parameter == "prompt", err.value
            assert "made without a tokenizer (skip_tokenizer_init): send token ids" in err.value.details
    finally:
        bridge.release(engine)       # its last ref: the engine shuts down (and counts no more for this client)
    assert wait_until(lambda: not (engine_processes(engine_worker) - before))


def test_an_engine_made_without_an_identity_and_left_unnamed_is_released(
        tmp_path_factory: pytest.TempPathFactory, model: Path) -> None:
    """Without authentication the engine limit is every client's together: two engines made by
    connections that had exited kept every later client from making one, for good. One that no call
    has named for idle_engine_s, and that holds no live request, is released and its core stopped."""
    w = start_worker(tmp_path_factory.mktemp("idle-engine"), "--idle-engine-s", "3", "--max-engines-per-client", "1",
                     "--model-dir", str(model.parent), name="idle-engine")
    try:
        with BridgeClient(w.address) as first:
            engine = first.call(f"{E}.from_engine_args", engine_args(model, max_model_len=256), timeout=120)
            assert len(engine_processes(w)) == 1
            for _ in range(3):                       # named by calls: kept
                time.sleep(1.5)
                assert first.call(Target.method(engine, "check_health")) is None
        assert wait_until(lambda: not engine_processes(w), timeout=30)
        with BridgeClient(w.address) as later:
            with pytest.raises(CallError) as err:
                later.call(Target.method(engine, "check_health"))
            assert err.value.code == grpc.StatusCode.NOT_FOUND and "(idle_engine_s)" in err.value.details, err.value
            again = later.call(f"{E}.from_engine_args", engine_args(model, max_model_len=256), timeout=120)
            assert later.release(again) == 1
    finally:
        w.stop()


def test_encode_on_a_pooling_engine_returns_a_vector_and_releasing_it_stops_the_engine(
        bridge: BridgeClient, model: Path, engine_worker: WorkerProcess) -> None:
    before = engine_processes(engine_worker)
    pooling = bridge.call(f"{E}.from_engine_args", engine_args(model, runner="pooling"), session_id="pooling")
    started = engine_processes(engine_worker) - before
    assert bridge.call(Target.method(pooling, "get_supported_tasks"), session_id="pooling") != ("generate",)
    items = list(bridge.stream(Target.method(pooling, "encode"), "embed me", {"task": "embed"}, "emb-1",
                               session_id="pooling"))
    vector = items[-1]["outputs"]["data"]
    assert vector.shape == (128,) and vector.dtype.is_floating_point
    # Sampling on an engine that only pools killed its core (an AssertionError in the model runner):
    # refused by the task, and the engine encodes on.
    for call in (lambda: list(bridge.stream(Target.method(pooling, "generate"), "hi", greedy(4), "gen-on-pool",
                                            session_id="pooling")),
                 lambda: bridge.call(Target.method(pooling, "add_request"), "add-on-pool", "hi", greedy(4),
                                     session_id="pooling")):
        with pytest.raises(CallError) as err:
            call()
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and err.value.reason == "unsupported task"
        assert "task 'generate' is not supported by this engine; supported tasks: " in err.value.details
    again = list(bridge.stream(Target.method(pooling, "encode"), "embed me", {"task": "embed"}, "emb-2",
                               session_id="pooling"))
    assert again[-1]["outputs"]["data"].shape == (128,)
    assert bridge.release(session_id="pooling") == 1
    assert wait_until(lambda: not (engine_processes(engine_worker) & started))


# --- Multiplex: many generations over one stream ------------------------------------------------

def test_multiplexed_generations_match_plain_streams_and_share_replies(bridge: BridgeClient) -> None:
    prompts = [f"multiplexed prompt {i}" for i in range(8)]
    plain = {p: list(bridge.stream(Target.method("engine", "generate"), p, greedy(24), f"plain-{i}"))[-1]
             for i, p in enumerate(prompts)}
    with bridge.multiplex() as mux:
        results = generate_together(mux, prompts, "mux")
        # A plain call over the same stream, between and after the streams.
        assert mux.call(Target.method("engine", "check_health")) is None
        events = sum(len(items) for items in results.values())
        replies = mux.replies
    assert sorted(results) == sorted(prompts)
    assert_same_generations(results, plain)
    for items in results.values():
        assert all(type(t) is int for t in items[-1]["outputs"][0]["token_ids"])
    # Items that the engine produced in the same step went out together.
    assert replies < events


def test_multiplexed_cancel_aborts_in_the_engine_and_other_calls_go_on(bridge: BridgeClient,
                                                                       engine_worker: WorkerProcess) -> None:
    with bridge.multiplex() as mux:
        doomed = mux.stream(Target.method("engine", "generate"), "cancel me", greedy(LONG), "mux-cancel")
        assert next(doomed)["finished"] is False
        doomed.close()    # sends a cancel for that call only
        assert_aborted_in_engine(engine_worker, bridge, "mux-cancel")
        ok = list(mux.stream(Target.method("engine", "generate"), "still here", greedy(4), "mux-after"))
        assert ok[-1]["finished"] is True and len(ok[-1]["outputs"][0]["token_ids"]) == 4


def test_multiplexed_errors_end_one_call_with_the_plain_status(bridge: BridgeClient) -> None:
    with bridge.multiplex() as mux:
        with pytest.raises(CallError) as err:
            list(mux.stream(Target.method("engine", "generate"), "x", {"max_tokens": "many"}, "mux-bad"))
        with pytest.raises(CallError) as plain:
            list(bridge.stream(Target.method("engine", "generate"), "x", {"max_tokens": "many"}, "plain-bad"))
        assert err.value.code == plain.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert err.value.category == plain.value.category and "max_tokens" in err.value.details
        with pytest.raises(CallError) as err:
            mux.call(Target.method("engine", "no_such_method"))
        assert err.value.code == grpc.StatusCode.PERMISSION_DENIED     # not a documented member
        # A per-call deadline ends that call only, and aborts its request in the engine.
        with pytest.raises(CallError) as err:
            list(mux.stream(Target.method("engine", "generate"), "slow", greedy(LONG), "mux-deadline",
                            timeout=0.2))
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert mux.call(Target.method("engine", "check_health")) is None
    assert drained(bridge)


@pytest.mark.parametrize("way", ["stream", "multiplex"])
def test_a_slow_reader_gets_merged_items_not_a_backlog(bridge: BridgeClient, way: str) -> None:
    """The reader stops after one item while the engine generates every token: the worker does not
    queue an item per token meanwhile (vLLM merges a waiting request's outputs), yet no token is lost.
    The client keeps gRPC's receive window at its initial 64 KiB (no BDP growth), so what the
    transport holds is small and what the worker holds shows. Items go whole: a window holds a few
    of those, but a thousand patches of a token each (as few bytes, as bounded a backlog)."""
    with BridgeClient(bridge.address, channel_options=[("grpc.http2.bdp_probe", 0)]) as client, \
            client.multiplex() as mux:
        source = mux if way == "multiplex" else client
        stream = source.stream(Target.method("engine", "generate"), "slow reader", greedy(LONG), f"slow-{way}",
                               stream_encoding="full")
        assert next(stream)["finished"] is False
        assert drained(bridge, timeout=120), "the engine never finished"
        rest = list(stream)
    assert rest[-1]["finished"] is True and len(rest[-1]["outputs"][0]["token_ids"]) == LONG
    # What was already on its way (gRPC's flow-control window) arrives one by one; the rest is merged.
    assert len(rest) < LONG // 10, len(rest)


# --- stream encodings: patches decode to the same items as whole values -------------------------

GENERATE = Target.method("engine", "generate")


def stream_cases() -> dict[str, tuple[str, dict[str, Any]]]:
    """(prompt, sampling params) of requests whose items exercise every part of a streamed
    RequestOutput: each output kind, logprobs (as lists and flat) and prompt logprobs, n > 1, stop
    tokens and strings."""
    from vllm.sampling_params import RequestOutputKind as K
    seeded = {"temperature": 1.0, "seed": 7, "n": 2, "max_tokens": 12}
    return {
        "cumulative": ("The quick brown fox", greedy(24)),
        "delta": ("The quick brown fox", greedy(24, output_kind=K.DELTA)),
        "final-only": ("The quick brown fox", greedy(24, output_kind=K.FINAL_ONLY)),
        "logprobs": ("A B C D", greedy(12, logprobs=3, prompt_logprobs=2)),
        "logprobs-delta": ("A B C D", greedy(12, logprobs=2, prompt_logprobs=1, output_kind=K.DELTA)),
        "flat-logprobs": ("A B C D", greedy(12, logprobs=2, flat_logprobs=True)),
        "n2": ("Once upon a time", seeded),
        "n2-delta": ("Once upon a time", {**seeded, "output_kind": K.DELTA}),
        "n2-final-only": ("Once upon a time", {**seeded, "output_kind": K.FINAL_ONLY}),
        "stop-token": ("Once upon a time", {"temperature": 0.0, "max_tokens": 16, "stop_token_ids": [493]}),
        "stop-string": ("Once upon a time", {"temperature": 0.0, "max_tokens": 16, "stop": [" today"]}),
    }


def assert_patches_decode_like_whole_values(source: BridgeClient | Multiplexer, tag: str) -> None:
    """Every case, streamed as patches with each item also sent whole right after its patch
    (`x-bridge-stream-tee`: both encoded from the same objects at the same moment), decodes to
    equal values item for item. (Two separate runs of a request are no check: where vLLM splits
    its items, and the stats it stamps on them, depend on timing.)"""
    for name, (prompt, params) in stream_cases().items():
        items = list(source.stream(GENERATE, prompt, params, f"{tag}-{name}", stream_tee=True))
        patched, whole = items[0::2], items[1::2]
        assert len(patched) == len(whole) >= 1, name
        assert patched == whole, name
        assert whole[-1]["finished"] is True, name
        if name in ("cumulative", "logprobs", "flat-logprobs"):
            assert len(whole) > 4, name       # streamed item by item, so most items were patches


def test_patched_streams_decode_to_the_same_items_as_whole_ones(bridge: BridgeClient) -> None:
    assert_patches_decode_like_whole_values(bridge, "enc")
    with bridge.multiplex() as mux:
        assert_patches_decode_like_whole_values(mux, "enc-mux")


def test_a_stream_tee_sends_each_item_as_a_patch_then_whole(engine_worker: WorkerProcess) -> None:
    from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

    with BridgeClient(engine_worker.address) as client:
        request, _ = client.request(GENERATE, ("tee", greedy(6), "tee"))
        items = list(pb_grpc.BridgeStub(client.channel).Stream(request, metadata=[
            ("x-bridge-stream-encoding", "patch-v1"), ("x-bridge-stream-tee", "1")]))
    assert [i.index for i in items] == list(range(len(items))) and len(items) % 2 == 0
    assert all(i.HasField("value") for i in items[1::2])
    assert items[0].HasField("value") and all(i.HasField("patch") for i in items[2::2])


@pytest.mark.parametrize("asked", [None, "full", "patch-v9"])
def test_a_client_that_does_not_ask_for_patches_gets_whole_values(engine_worker: WorkerProcess,
                                                                   asked: str | None) -> None:
    """What grpcurl, an older client or another language's stack sees: every item a whole Value."""
    from vllm_bridge.v1 import bridge_pb2 as pb
    from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

    with BridgeClient(engine_worker.address) as client:
        request, _ = client.request(GENERATE, ("plain items", greedy(16), f"plain-{asked}"))
        metadata = [] if asked is None else [("x-bridge-stream-encoding", asked)]
        items = list(pb_grpc.BridgeStub(client.channel).Stream(request, metadata=metadata))
        asked_patches = [("x-bridge-stream-encoding", "patch-v1")]
        patched = list(pb_grpc.BridgeStub(client.channel).Stream(request, metadata=asked_patches))
        rows = list(pb_grpc.BridgeStub(client.channel).Stream(request, metadata=[
            ("x-bridge-stream-encoding", "patch-v2")]))
    assert len(items) >= 2 and all(i.HasField("value") and not i.HasField("patch") for i in items)
    assert patched[0].HasField("value") and all(i.HasField("patch") for i in patched[1:])
    assert sum(len(i.SerializeToString()) for i in patched) < sum(len(i.SerializeToString()) for i in items) / 3
    assert isinstance(items[0], pb.StreamItem)
    # patch-v2: the items that change what the item before changed (all but the first few and the
    # last) are rows, half the size of their ops
    # (how many items there are depends on timing: vLLM merges the outputs of a slower reader)
    assert not any(i.patch.HasField("row") for i in patched)
    as_rows = [i for i in rows if i.patch.HasField("row")]
    assert len(as_rows) >= len(rows) - 4 >= 4
    assert statistics.mean(i.ByteSize() for i in as_rows) < statistics.mean(i.ByteSize() for i in patched[3:-1]) * 0.6


BAD_REQUESTS = [   # (what, prompt, sampling params, extra kwargs, status, words the message must hold)
    ("negative token id", {"prompt_token_ids": [5, -1]}, greedy(2), {}, grpc.StatusCode.INVALID_ARGUMENT,
     "prompt.prompt_token_ids[1]: token id -1 is outside this model's vocabulary (0 to 1023)"),
    ("token id past the model's vocabulary", {"prompt_token_ids": [1024]}, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "prompt.prompt_token_ids[0]: token id 1024 is outside"),
    ("token ids that are not ints", {"prompt_token_ids": [1, "2"]}, greedy(2), {}, grpc.StatusCode.INVALID_ARGUMENT,
     "at TokensPrompt.prompt_token_ids[1]: Input should be a valid integer"),
    ("completions in the millions", "hi", {**greedy(2), "n": 1_000_000}, {}, grpc.StatusCode.RESOURCE_EXHAUSTED,
     "field n: 1000000 completions of one prompt is over this server's limit of 256"),
    ("an int past 64 bits", "hi", greedy(2, seed=2**70), {}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter sampling_params: cannot build SamplingParams from the map given: field seed: "
     "1180591620717411303424 does not fit in 64 bits"),
    ("a priority past 64 bits", "hi", greedy(2), {"priority": 2**100}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter priority"),
    ("a priority of the client's own on a shared engine", "hi", greedy(2), {"priority": -5},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter priority: this engine is shared, and the server ranks its requests"),
    ("a tokenizer option of the wrong type", "hi", greedy(2), {"tokenization_kwargs": {"add_special_tokens": "yes"}},
     grpc.StatusCode.INVALID_ARGUMENT, "tokenization_kwargs['add_special_tokens']: expected bool, got str 'yes'"),
    # vLLM hands the map to the tokenizer: padded to a billion tokens in the process every client shares
    ("padding to a billion tokens", "hi", greedy(2),
     {"tokenization_kwargs": {"padding": "max_length", "max_length": 10**9}}, grpc.StatusCode.INVALID_ARGUMENT,
     "tokenization_kwargs['padding']: not a tokenizer option this server passes on"),
    # vLLM makes no truncation tokenization_kwargs ask for: such a text was tokenized whole (2-3 s for
    # a million characters, on the thread every client's long requests share), then refused by a bare
    # ValueError naming nothing
    ("a text that cannot fit, with a truncation vLLM does not make", "x y " * 10_000, greedy(2),
     {"tokenization_kwargs": {"truncation": True, "max_length": 8}}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter prompt: a prompt of 40,000 characters cannot fit this engine's max_model_len of 2,048"),
    ("a max_length past the model's", "hi", greedy(2), {"tokenization_kwargs": {"truncation": True,
                                                                                "max_length": 10**9}},
     grpc.StatusCode.INVALID_ARGUMENT, "expected 1 to this engine's max_model_len (2,048), got 1000000000"),
    # Sampling params' token ids index the logits in the engine core (a stop id past the vocabulary
    # with min_tokens killed it), and their private fields reach it unchecked.
    ("a stop token id past the vocabulary", "hi", {**greedy(4), "min_tokens": 2, "stop_token_ids": [5000]}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.stop_token_ids[0]: token id 5000 is outside"),
    ("a negative allowed token id", "hi", {**greedy(2), "allowed_token_ids": [3, -2]}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.allowed_token_ids[1]: token id -2 is outside"),
    ("a logit bias past the vocabulary", "hi", {**greedy(2), "logit_bias": {2**40: 1.0}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.logit_bias[0]: token id 1099511627776 is outside"),
    ("a schema nested 400 deep", "hi",
     {**greedy(2), "structured_outputs": {"json": '{"type":"array","items":' * 400 + '{"type":"string"}' + "}" * 400}},
     {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "structured_outputs.json: it nests 401 levels deep, over this server's"),
    ("a structural tag nested past Python's limit", "hi",
     {**greedy(2), "structured_outputs": {"structural_tag": "[" * 60_000 + "]" * 60_000}},
     {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "structural_tag: it nests deeper than Python's JSON parser goes, over"),
    ("an int past 64 bits inside a field", "hi", {**greedy(2), "extra_args": {"k": [1, 2**70]}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "field extra_args['k'][1]: 1180591620717411303424 does not fit in 64 bits"),
    ("an object of thousands of optional properties", "hi",
     {**greedy(2), "structured_outputs": {"json": {"type": "object",
                                                   "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}}},
     {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "it declares 4,000 properties, 4,000 in one object, over this server's"),
    # compiled on the thread that prepares every structured request, and kept by the engine core (a
    # 10 MB enum: 37 s, 2.9 GB for good)
    ("a schema's enum of 20,000 strings", "hi",
     {**greedy(2), "structured_outputs": {"json": {"enum": [f"value-{i:05d}" for i in range(20_000)]}}},
     {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "characters in all, over this server's limit of 131,072"),
    ("a choice of 20,000 strings", "hi",
     {**greedy(2), "structured_outputs": {"choice": [f"value-{i:05d}" for i in range(20_000)]}},
     {}, grpc.StatusCode.RESOURCE_EXHAUSTED, "hold 240,000 characters in all, over this server's limit of 131,072"),
    # vLLM tokenizes bad words on the one thread that serves every client's (16 s for 16 MB of them)
    ("bad words of too many characters", "hi", {**greedy(2), "bad_words": ["ab" * 35_000, "cd" * 35_000]}, {},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "field bad_words: 140,000 characters in all is over this server's limit"),
    ("a stop string of too many characters", "hi", {**greedy(2), "stop": "x" * 140_000}, {},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "field stop: 140,000 characters in all is over this server's limit"),
    # vLLM detokenizes every logprob on the worker's loop, and one item may hold them all: 5 s of it
    ("logprobs in the hundreds of thousands", "hi", {**greedy(100), "n": 128, "temperature": 0.8, "logprobs": 20}, {},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "comes to 268,800 logprobs, over this server's limit of 32,768"),
    # ... and each completion works out the prompt's logprobs again (n=256 over 80 words: the loop 3.3 s)
    ("prompt logprobs for every completion", "word " * 80, {**greedy(4), "n": 64, "temperature": 0.8,
                                                            "prompt_logprobs": 20}, {},
     grpc.StatusCode.RESOURCE_EXHAUSTED, "comes to 548,352 logprobs"),
    # A structural tag of neither shape vLLM reads is refused by its part (guidance's checks
    # indexed it unchecked: a bare KeyError)
    ("a structural tag of neither shape", "hi", {**greedy(2), "structured_outputs": {"structural_tag": "{}"}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "structural_tag: expected an object with a 'format' (or with 'structures'"),
    ("a structural tag's structures without triggers", "hi", {**greedy(2), "structured_outputs": {
        "structural_tag": '{"structures": [{"begin": "<a>", "schema": {}, "end": "</a>"}]}'}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "structural_tag['triggers']: expected a list of text, got none"),
    ("a structural tag's format that is not an object", "hi", {**greedy(2), "structured_outputs": {
        "structural_tag": '{"format": 5}'}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter sampling_params.structured_outputs: vLLM could not read it: Key"),
    ("every token's logprob (-1), past max_logprobs", "hi", {**greedy(2), "logprobs": -1}, {},
     grpc.StatusCode.INVALID_ARGUMENT, ("parameter sampling_params.logprobs: -1, every token of the vocabulary "
                                        "(1,024) is more than this engine returns per token (max_logprobs 20)")),
    ("prompt logprobs past max_logprobs", "hi", {**greedy(2), "prompt_logprobs": 21}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter sampling_params.prompt_logprobs: 21 is more than this engine"),
    # prompt forms and options vLLM refused deep in its input processing, naming nothing
    ("an empty list of prompt token ids", {"prompt_token_ids": []}, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt.prompt_token_ids: expected at least one token id"),
    ("images for a model that is not multimodal", {"prompt": "hi", "multi_modal_data": {"image": "x"}}, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt.multi_modal_data: this engine's model is not multimodal"),
    ("an encoder-decoder prompt for a decoder-only model", {"encoder_prompt": "hi", "decoder_prompt": "x"},
     greedy(2), {}, grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt: an encoder-decoder prompt"),
    ("a prompt key of no prompt form", {"prompt": "hi", "no_such_key": 1}, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt['no_such_key']: not a key of a prompt"),
    ("prompt embeddings for an engine that takes none", {"prompt_embeds": torch.zeros(3, 64)}, greedy(2), {},
     grpc.StatusCode.FAILED_PRECONDITION, "parameter prompt.prompt_embeds: this engine takes no prompt embeddings"),
    ("a prompt_embeds key of None, which vLLM refuses all the same", {"prompt_embeds": None, "prompt_token_ids": [1]},
     greedy(2), {}, grpc.StatusCode.FAILED_PRECONDITION, "parameter prompt.prompt_embeds: this engine takes no prompt"),
    ("a data parallel rank the engine lacks", "hi", greedy(2), {"data_parallel_rank": 5},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter data_parallel_rank: expected a rank of this engine's 1"),
    ("a prompt text beside a prompt", "hi", greedy(2), {"prompt_text": "x"},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt_text: vLLM takes it only with a prompt that is a request"),
    ("an empty list of allowed token ids", "hi", {**greedy(2), "allowed_token_ids": []}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.allowed_token_ids: expected at least one token id"),
    ("a schema that is not JSON", "hi", {**greedy(2), "structured_outputs": {"json": "not json"}}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter sampling_params.structured_outputs: vLLM refused it: JSONDecodeErr"),
    ("a truncation past the model's length", "hi", {**greedy(2), "truncate_prompt_tokens": 10**6}, {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter sampling_params.truncate_prompt_tokens: vLLM refused it: "
     "truncate_prompt_tokens value (1000000) is greater than max_model_len"),
    ("a private field of SamplingParams", "hi", {**greedy(2), "_bad_words_token_ids": [[5000]]}, {},
     grpc.StatusCode.PERMISSION_DENIED, "field _bad_words_token_ids on SamplingParams is private"),
    ("another private field of SamplingParams", "hi", {**greedy(4), "min_tokens": 2, "_all_stop_token_ids": {5000}},
     {}, grpc.StatusCode.PERMISSION_DENIED, "field _all_stop_token_ids on SamplingParams is private"),
    # vLLM checks a prompt's length once it has its tokens, with a bare ValueError that names nothing
    ("a text longer than the model takes", "word " * 3000, greedy(2), {}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter prompt: vLLM refused it: The decoder prompt (length 3003) is longer than the maximum model length"),
    ("a text of multi-byte characters longer than the model takes", "\u00e9\u4e2d" * 700, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt: vLLM refused it: The decoder prompt (length"),
    ("token ids that leave no room for output", {"prompt_token_ids": [5] * 2048}, greedy(2), {},
     grpc.StatusCode.INVALID_ARGUMENT, "parameter prompt: vLLM refused it: The decoder prompt (length 2048) plus the "
     "number of requested output tokens"),
    # vLLM ends no sequence before min_tokens, not even at max_model_len, and generates none past it:
    # such a request never ended, and 16 of them (or one of n=16) held every seat of the engine's batch
    ("a min_tokens that cannot follow the prompt within the model's length", "hi",
     {**greedy(2100), "min_tokens": 2100, "n": 4, "temperature": 0.8}, {}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter sampling_params.min_tokens: 2,100 tokens cannot follow this prompt's"),
    ("a min_tokens past the room token ids leave, with no max_tokens", {"prompt_token_ids": [5] * 2000},
     {"max_tokens": None, "min_tokens": 49, "temperature": 0.0}, {}, grpc.StatusCode.INVALID_ARGUMENT,
     "parameter sampling_params.min_tokens: 49 tokens cannot follow this prompt's 2,000 within the engine's "
     "max_model_len of 2,048 (at most 48 can)"),
]


@pytest.mark.parametrize("what,prompt,params,extra,code,needle", BAD_REQUESTS, ids=[c[0] for c in BAD_REQUESTS])
def test_a_request_that_would_harm_the_engine_is_refused_by_name_and_the_engine_serves_on(
        bridge: BridgeClient, what: str, prompt: Any, params: dict[str, Any], extra: dict[str, Any],
        code: grpc.StatusCode, needle: str) -> None:
    with pytest.raises(CallError) as err:
        list(bridge.stream(GENERATE, prompt, params, f"harm-{what}", kwargs=extra, timeout=60))
    assert err.value.code == code and needle in err.value.details, err.value.details
    # named as the call made, whatever check refused it (a sampling field's rule named vllm.SamplingParams)
    assert err.value.detail is not None and err.value.detail.target.endswith(".generate"), err.value.detail
    assert bridge.call(Target.method("engine", "check_health")) is None
    good = list(bridge.stream(GENERATE, {"prompt_token_ids": [1, 2, 1023]}, greedy(3), f"harm-after-{what}"))
    assert good[-1]["finished"] is True and len(good[-1]["outputs"][0]["token_ids"]) == 3


def test_the_engine_core_ends_a_sequence_at_the_models_length_whatever_its_min_tokens() -> None:
    """vLLM's own check_stop returns before its length cap while min_tokens is unmet, and its
    scheduler gives a sequence no token past max_model_len: such a sequence never ended. The core's
    check (`adapters.engine_core`, loaded in every engine core) ends it there."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import Request, RequestStatus

    from adapters.engine_core import stop_bounded
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=50, min_tokens=50), None, eos_token_id=2)
    stop = stop_bounded(check_stop)
    for _ in range(6):
        request.append_output_token_ids(7)
        assert not stop(request, 10)             # short of the model's length (10): min_tokens holds
    request.append_output_token_ids(7)          # 10 tokens: the model's length, 7 of 50 min_tokens
    assert not check_stop(request, 10) and request.status == RequestStatus.WAITING    # vLLM's: on for ever
    assert stop(request, 10) and request.status == RequestStatus.FINISHED_LENGTH_CAPPED


def test_a_min_tokens_that_fills_the_room_the_prompt_leaves_is_served_to_the_end(bridge: BridgeClient) -> None:
    """The bound on min_tokens is the room exactly: a request that fills it ends at max_model_len (so
    the refusal above takes nothing a request can use), one token more is refused."""
    room = {"prompt_token_ids": [5] * 2040}
    items = list(bridge.stream(GENERATE, room, {**greedy(8), "min_tokens": 8}, "room-exactly", timeout=60))
    assert items[-1]["finished"] is True and len(items[-1]["outputs"][0]["token_ids"]) == 8
    with pytest.raises(CallError) as err:
        list(bridge.stream(GENERATE, room, {**greedy(9), "min_tokens": 9}, "room-and-one", timeout=60))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "(at most 8 can)" in err.value.details
    assert err.value.detail is not None and err.value.detail.parameter == "sampling_params.min_tokens"
    with pytest.raises(CallError) as err:        # the same request through add_request: its params
        bridge.call(Target.method("engine", "add_request"), "room-added", "hi", {**greedy(4000), "min_tokens": 4000},
                    timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "(at most 2,046 can)" in err.value.details
    assert err.value.detail is not None and err.value.detail.parameter == "params.min_tokens"


def test_a_member_asked_for_with_the_wrong_kind_is_told_the_kind_to_use(bridge: BridgeClient) -> None:
    """GET_ATTR of a method was refused as "the result holds a method" (PERMISSION_DENIED, no target),
    or by the method's own guard (a read of `shutdown`: "only engines a client made itself can be shut
    down"); METHOD of an attribute named no parameter."""
    for target, said in ((Target.get("engine", "generate"), "generate is a method, not an attribute: use METHOD"),
                         (Target.get("engine", "shutdown"), "shutdown is a method, not an attribute: use METHOD"),
                         (Target.method("engine", "errored"), "errored is an attribute, not a method: use GET_ATTR")):
        with pytest.raises(CallError) as err:
            bridge.call(target)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and said in err.value.details, err.value
        assert err.value.detail is not None and err.value.detail.parameter == "target.kind", err.value.detail
    assert bridge.call(Target.method("engine", "check_health")) is None


def test_a_ref_in_the_plug_in_options_is_refused_and_leaves_no_request_behind(bridge: BridgeClient) -> None:
    """vLLM registers a request in the worker before it sends it to its engine core as msgpack: an
    object there that msgpack cannot carry failed it only then, and the request's state stayed."""
    config = bridge.call("vllm.config.ParallelConfig")
    with pytest.raises(CallError) as err:
        list(bridge.stream(GENERATE, "hi", {**greedy(2), "extra_args": {"options": [config]}}, "plain-data-only"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "field extra_args['options'][0]: expected plain data" in err.value.details, err.value.details
    assert "got ParallelConfig" in err.value.details
    bridge.release(config)
    good = list(bridge.stream(GENERATE, "hi", greedy(2), "plain-data-only"))     # the same id: nothing left of it
    assert good[-1]["finished"] is True


def test_a_start_with_a_running_calls_id_is_refused_under_id_0_and_the_running_call_goes_on(
        engine_worker: WorkerProcess) -> None:
    import queue

    from vllm_bridge.v1 import bridge_pb2 as pb
    from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

    with BridgeClient(engine_worker.address) as client:
        # call 1 runs until this test cancels it: nothing it sends can race the second start
        request, _ = client.request(GENERATE, ("duplicate ids", greedy(2000), "dup-first"))
        again, _ = client.request(GENERATE, ("duplicate ids", greedy(4), "dup-second"))
        outgoing: queue.Queue[Any] = queue.Queue()
        outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=1, stream=True, call=request)))
        events: list[Any] = []
        refused_at = None
        for reply in pb_grpc.BridgeStub(client.channel).Multiplex(iter(outgoing.get, None), timeout=120):
            for event in reply.events:
                events.append(event)
                kind = event.WhichOneof("kind")
                if len(events) == 1:            # call 1 runs: start another call 1
                    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=1, stream=True, call=again)))
                if event.id == 0 and refused_at is None:
                    refused_at = len(events)
                elif event.id == 1 and kind == "value" and refused_at is not None and len(events) == refused_at + 1:
                    outgoing.put(pb.MuxRequest(cancel=1))           # call 1 went on after the refusal
                if event.id == 1 and kind in ("end", "error"):
                    outgoing.put(None)
    refused = [e for e in events if e.id == 0]
    assert len(refused) == 1 and "call id 1 is still running" in refused[0].error.message, refused
    first = [e.WhichOneof("kind") for e in events if e.id == 1]
    assert refused_at is not None and events[refused_at].id == 1 and first.count("error") == 1, first
    assert first[-1] == "error" and events[-1].error.code == grpc.StatusCode.CANCELLED.value[0], events[-1]
    assert set(first[:-1]) == {"value"} and len(first) > 2, first


def test_an_enum_given_by_value_is_the_member_vllm_compares_with(bridge: BridgeClient) -> None:
    """output_kind 2 is FINAL_ONLY: one item, the whole text. Passed on as a bare 2, vLLM took it
    for no kind it knows (it compares with members) and streamed every token."""
    final = list(bridge.stream(GENERATE, "by value", {**greedy(5), "output_kind": 2}, "kind-by-value"))
    assert len(final) == 1 and final[0]["finished"] is True, final
    assert len(final[0]["outputs"][0]["token_ids"]) == 5
    # DELTA: each item holds only its new tokens (vLLM merges those a slow reader has not taken yet),
    # so they add up to the generation; cumulative items, which a bare 1 gave, add up to more
    delta = list(bridge.stream(GENERATE, "by value", {**greedy(40), "output_kind": 1}, "kind-by-value"))
    assert sum(len(item["outputs"][0]["token_ids"]) for item in delta) == 40, delta


def test_a_structured_output_only_another_backend_takes_is_refused_and_the_engine_serves_on(
        bridge: BridgeClient) -> None:
    """On backend `auto` vLLM hands what xgrammar cannot take to guidance for that request alone, and
    its engine core, which compiles with xgrammar, died on it (every stream failed ~12 s)."""
    an_object = {**greedy(4), "structured_outputs": {"json": {"type": "object"}}}
    json_ok = list(bridge.stream(GENERATE, "an object", an_object, "so-xgrammar"))
    assert json_ok[-1]["finished"] is True                 # xgrammar's, and the core's, first structured request
    with pytest.raises(CallError) as err:     # xgrammar refuses a choice holding a newline; guidance takes it
        list(bridge.stream(GENERATE, "Hello", {**greedy(4), "structured_outputs": {"choice": ["yes\n", "no\n"]}},
                           "so-other-backend"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.detail is not None and err.value.detail.parameter == "sampling_params.structured_outputs"
    assert "xgrammar" in err.value.details and "guidance" in err.value.details, err.value.details
    with pytest.raises(CallError) as err:     # what neither takes: vLLM's own refusal, as before
        list(bridge.stream(GENERATE, "Hello", {**greedy(4), "structured_outputs": {"regex": "(?=a)a"}}, "so-none"))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "look-around" in err.value.details, err.value
    after = list(bridge.stream(GENERATE, "Hello", greedy(4), "so-after"))
    assert after[-1]["finished"] is True and len(after[-1]["outputs"][0]["token_ids"]) == 4


def test_structural_tags_of_both_shapes_vllm_reads_pass_the_shape_check(bridge: BridgeClient) -> None:
    """The check of a structural tag's shape must let through both that vLLM reads: the older
    `structures` and `triggers`, and one with a `format` (here a constant string, which the output
    then is, up to its end of sequence)."""
    older = '{"structures": [{"begin": "<a>", "schema": {"type": "integer"}, "end": "</a>"}], "triggers": ["<a"]}'
    items = list(bridge.stream(GENERATE, "Hello", {**greedy(6), "structured_outputs": {"structural_tag": older}},
                               "tag-older"))
    assert items[-1]["finished"] is True
    formatted = '{"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}'
    items = list(bridge.stream(GENERATE, "Hello", {**greedy(6), "ignore_eos": False,
                                                   "structured_outputs": {"structural_tag": formatted}}, "tag-format"))
    assert items[-1]["outputs"][0]["text"] == "hi" and items[-1]["outputs"][0]["finish_reason"] == "stop"


def test_a_grammar_that_compiles_too_long_is_refused_and_structured_requests_go_on(bridge: BridgeClient) -> None:
    """The 15-character regex `[ab]*a[ab]{20}` kept an engine core thread compiling for over 44
    minutes (xgrammar's automaton doubles with each repeat), and vLLM compiles every structured
    request of the engine on (cores + 1) // 2 threads: on 2 cores, one. The worker tries a new
    grammar first (compiles it, generates under it) in a process it stops at `grammar_compile_s`;
    the engine never sees these."""
    slow = {**greedy(4), "structured_outputs": {"regex": "[ab]*a[ab]{20}"}}
    for tag in ("so-slow", "so-slow-again"):        # the second time from what the worker remembers
        with pytest.raises(CallError) as err:
            list(bridge.stream(GENERATE, "Hello", slow, tag, timeout=120))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert err.value.detail is not None and err.value.detail.parameter == "sampling_params.structured_outputs"
        assert err.value.detail.reason == "grammar too costly", err.value.detail
        assert f"within {COMPILE_S} s" in err.value.details and "grammar_compile_s" in err.value.details
    # Compiled at once, but every token's mask costs more than the one before (16 such sequences
    # stopped every request of the engine for 5 minutes).
    ambiguous = {"temperature": 1.0, "max_tokens": 250, "min_tokens": 250, "n": 4,
                 "structured_outputs": {"grammar": 'root ::= e\ne ::= e e | e e e | "a" | "b" | "ab"'}}
    with pytest.raises(CallError) as err:
        list(bridge.stream(GENERATE, "Hello", ambiguous, "so-ambiguous", timeout=120))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "ms a token" in err.value.details, err.value
    # Had the core been given it, these would wait behind it for the better part of an hour.
    digits = list(bridge.stream(GENERATE, "Hello", {**greedy(3), "structured_outputs": {"regex": "[0-9]{3}"}},
                                "so-digits", timeout=60))
    assert digits[-1]["finished"] is True and re.fullmatch("[0-9]{3}", digits[-1]["outputs"][0]["text"]), digits[-1]
    shaped = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    obj = list(bridge.stream(GENERATE, "Hello", {"temperature": 0.0, "max_tokens": 40,
                                                 "structured_outputs": {"json": shaped}}, "so-object", timeout=60))
    assert obj[-1]["finished"] is True and obj[-1]["outputs"][0]["token_ids"], obj[-1]
    assert list(bridge.stream(GENERATE, "Hello", greedy(2), "so-plain-after"))[-1]["finished"] is True


def test_structured_requests_share_engine_steps_with_plain_ones(engine_worker: WorkerProcess,
                                                               bridge: BridgeClient) -> None:
    """A step that held rows with a grammar and rows without made vLLM pin memory for xgrammar's row
    list, which needs a CUDA driver: the engine core died on CPU (any structured request beside any
    other one did it). Every kind, beside a plain generation that runs throughout."""
    import threading
    plain: list[Any] = []
    stop = threading.Event()

    failed: list[Exception] = []

    def run_plain() -> None:
        try:
            with BridgeClient(engine_worker.address) as other:
                for item in other.stream(GENERATE, "a long plain one", greedy(1900), "beside-plain", timeout=120):
                    plain.append(item)
                    if stop.is_set():
                        break       # closing the stream cancels the call
        except Exception as exc:     # noqa: BLE001 - the test says which, after the thread
            failed.append(exc)

    kinds = [{"choice": ["yes", "no"]}, {"json": {"type": "object"}}, {"regex": "[a-z]{3}"},
             {"grammar": 'root ::= "a" | "b"'}]
    # Each grammar's first trial (seconds, in a child process) comes first, so that the plain generation
    # outlasts the structured ones however cold the engine is (run alone, this test failed so).
    for i, kind in enumerate(kinds):
        list(bridge.stream(GENERATE, "Hello", {**greedy(2), "structured_outputs": kind}, f"tried-{i}", timeout=60))
    runner = threading.Thread(target=run_plain)
    runner.start()
    try:
        for i, kind in enumerate(kinds):
            items = list(bridge.stream(GENERATE, "Hello", {**greedy(6), "structured_outputs": kind}, f"beside-{i}",
                                       timeout=60))
            assert items[-1]["finished"] is True, (kind, items[-1])
        assert plain and runner.is_alive(), "the plain generation was not running beside the structured ones"
    finally:
        stop.set()
        runner.join(120)
    assert not failed and plain[-1]["finished"] is False and len(plain) >= 4, failed   # ended by the test
    assert list(bridge.stream(GENERATE, "Hello", greedy(2), "beside-after"))[-1]["finished"] is True


def test_every_socket_an_engine_listens_on_is_at_loopback(engine_worker: WorkerProcess, bridge: BridgeClient) -> None:
    """vLLM's engine core makes a process group of its own, at the address the machine's name
    resolves to, and torch's store server listened on every interface: anyone who reached the
    machine could write to it. The worker and its engine core listen at loopback only."""
    import ipaddress

    import psutil
    assert list(bridge.stream(GENERATE, "Hello", greedy(2), "listening"))[-1]["finished"] is True
    root = psutil.Process(engine_worker.proc.pid)
    listening = [(p.pid, p.name(), c.laddr) for p in (root, *root.children(recursive=True))
                 for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
    assert any(pid != root.pid for pid, _, _ in listening), listening        # the engine core's store
    for pid, name, addr in listening:
        ip = ipaddress.ip_address(addr.ip)
        assert (getattr(ip, "ipv4_mapped", None) or ip).is_loopback, (pid, name, addr)


def test_a_coalesced_stream_ends_with_its_finished_item_not_an_interval_later(bridge: BridgeClient) -> None:
    started = time.monotonic()
    items = list(bridge.stream(GENERATE, "short", greedy(3), "interval-end", stream_interval_s=2.0))
    took = time.monotonic() - started
    assert items[-1]["finished"] is True and len(items[-1]["outputs"][0]["token_ids"]) == 3
    # the first item at once, the finished one an interval later (merged meanwhile), then the end
    # at once: two intervals would be 4 s. On a busy machine vLLM may have merged all three tokens
    # before the first item was asked for: that item is then the finished one, and the end comes at
    # once, with no interval at all.
    assert len(items) in (1, 2), items
    if len(items) == 2:
        assert 1.9 <= took < 3.5, took
    else:
        assert took < 1.9, took


def test_streams_of_dear_whole_items_are_paced_and_lose_nothing(bridge: BridgeClient) -> None:
    """Whole CUMULATIVE items with 20 logprobs grow by ~2 KB a token (milliseconds to encode, for
    every token, from ~100 tokens on): such a stream waits in proportion before its next item
    (bridge_server/worker/streams.py, Pace) while vLLM merges its outputs. Its last item still holds
    every token and every token's logprobs, and a DELTA stream's items still add up to every token,
    as the same request patched."""
    from vllm.sampling_params import RequestOutputKind as K
    n, prompt = 400, "Paced streams keep every token"
    patched = list(bridge.stream(GENERATE, prompt, greedy(n, logprobs=20), "paced-patched"))
    whole = list(bridge.stream(GENERATE, prompt, greedy(n, logprobs=20), "paced-whole", stream_encoding="full"))
    delta = list(bridge.stream(GENERATE, prompt, greedy(n, logprobs=20, output_kind=K.DELTA), "paced-delta",
                               stream_encoding="full"))
    tokens = patched[-1]["outputs"][0]["token_ids"]
    assert len(tokens) == n
    last = whole[-1]["outputs"][0]
    assert last["token_ids"] == tokens and whole[-1]["finished"] is True
    assert len(last["logprobs"]) == n and all(t in lp for t, lp in zip(tokens, last["logprobs"]))
    assert [t for item in delta for t in item["outputs"][0]["token_ids"]] == tokens
    assert len([lp for item in delta for lp in item["outputs"][0]["logprobs"]]) == n


def test_a_request_vllm_refuses_fails_alike_over_every_transport_and_encoding(bridge: BridgeClient) -> None:
    """A refused request (one vLLM's own prompt check refuses, named by the worker) fails with the same
    status over Stream and Multiplex, patched, whole and coalesced."""
    too_long = "word " * 3000       # past max_model_len
    errors = []
    with bridge.multiplex() as mux:
        for source, options in ((bridge, {}), (mux, {}), (mux, {"stream_interval_s": 0.01}),
                                (bridge, {"stream_encoding": "full"})):
            with pytest.raises(CallError) as err:
                list(source.stream(GENERATE, too_long, greedy(4), f"refused-{len(errors)}", **options))
            errors.append(err.value)
        assert mux.call(Target.method("engine", "check_health")) is None
    assert len({(e.code, e.category, e.detail.python_type if e.detail else "") for e in errors}) == 1, errors
    assert "longer than the maximum model length" in errors[0].details and errors[0].detail.parameter == "prompt"


@pytest.mark.parametrize("arrival", [float("nan"), float("inf"), 1e308, -1.0])
def test_an_arrival_time_off_the_clock_is_refused_by_name(bridge: BridgeClient, arrival: float) -> None:
    """vLLM measures a request's latencies from its arrival_time, into statistics every client's
    requests share: NaN or 1e308 made them NaN or absurd."""
    with pytest.raises(CallError) as err:
        bridge.call(Target.method("engine", "add_request"), "arrival", "Hello", greedy(2), arrival, timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "parameter arrival_time: expected a time.time() within a day" in err.value.details, err.value


def room_again(call: Any, reason: str, within_s: float = 10.0) -> None:
    """Runs `call` until a bound (`reason`) no longer refuses it: a released request's room comes back
    once its abort has reached vLLM, a moment later."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            call()
            return
        except CallError as again:
            assert again.reason == reason and time.monotonic() < deadline, again
            time.sleep(0.2)


def test_live_requests_together_are_bounded_in_logprobs_and_the_server_ranks_them(
        engine_worker: WorkerProcess, bridge: BridgeClient) -> None:
    """Each request within its own bound, eight at once held the worker's loop 10 s: the live
    requests of a shared engine may produce at most twice one request's logprobs, a host at most
    three quarters of what other hosts leave, a client the same of its host's. On a shared engine
    that schedules by priority, the server's rank is the order: an arrival_time of the client's own
    (vLLM's tie-break: a day in the past went ahead of everyone) is refused."""
    add = Target.method("engine", "add_request")
    near_bound = {**greedy(1500), "logprobs": 20}                     # 31,500 logprobs
    held = bridge.call(add, "lp-live-0", "Hello", near_bound, timeout=30)
    with pytest.raises(CallError) as err:
        bridge.call(add, "lp-live-1", "Hello", near_bound, timeout=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many logprobs", err.value
    assert "may produce 31,500 logprobs (31,500 of them this host's, 31,500 this client's)" in err.value.details
    own = [("grpc.use_local_subchannel_pool", 1)]
    with BridgeClient(engine_worker.address, channel_options=own) as neighbour:    # same host, what is left
        with pytest.raises(CallError) as err:
            neighbour.call(add, "lp-live-2", "Hello", near_bound, timeout=30)
        assert err.value.reason == "too many logprobs", err.value
        small = neighbour.call(add, "lp-live-3", "Hello", {**greedy(400), "logprobs": 20}, timeout=30)   # 8,400
        neighbour.release(small)
    assert bridge.release(held) == 1                                   # aborted: room again
    room_again(lambda: bridge.release(bridge.call(add, "lp-live-4", "Hello", near_bound, timeout=30)),
               "too many logprobs")
    with pytest.raises(CallError) as err:
        bridge.call(add, "own-arrival", "Hello", greedy(2), time.time() - 5, timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "parameter arrival_time: this engine is shared, and the server ranks" in err.value.details, err.value


def test_what_a_request_adds_to_every_engine_step_is_bounded_alone_and_together(
        engine_worker: WorkerProcess, bridge: BridgeClient) -> None:
    """vLLM's engine core walks each sequence's bad words in Python at every step, and scans its stop
    token ids: 4,096 one-token bad words at n=16 made every step of every client 0.24 s, a million stop
    ids at n=64 0.43 s, health SERVING. A request may add 2,000 µs to each step (4 µs a bad word and
    sequence, 0.03 µs a stop id or logit bias), the live requests of a shared engine twice that
    together, a client three quarters of its host's share."""
    add = Target.method("engine", "add_request")
    for params, field in (({"n": 16, "temperature": 0.8, "bad_words": ["!"] * 4096}, "bad_words"),
                          ({"stop_token_ids": [0] * 100_000}, "stop_token_ids"),
                          ({"n": 128, "temperature": 0.8, "logit_bias": {i: 1.0 for i in range(1000)}}, "logit_bias")):
        with pytest.raises(CallError) as err:
            bridge.call(add, f"step-{field}", "Hello", {**greedy(4), **params}, timeout=30)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too costly per step"
        assert err.value.detail is not None and err.value.detail.parameter == f"params.{field}", err.value
        assert "µs that the engine core would add to every step" in err.value.details, err.value
    dear = {**greedy(1000), "bad_words": ["!"] * 475}                # 1,900 µs a step
    held = bridge.call(add, "step-live-0", "Hello", dear, timeout=30)
    with pytest.raises(CallError) as err:
        bridge.call(add, "step-live-1", "Hello", dear, timeout=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too costly per step"
    assert "add to every step of its engine core 1,900 µs (1,900 of them this host's, 1,900 this client's)" \
        in err.value.details, err.value
    own = [("grpc.use_local_subchannel_pool", 1)]
    with BridgeClient(engine_worker.address, channel_options=own) as neighbour:    # same host, what is left
        with pytest.raises(CallError) as err:
            neighbour.call(add, "step-live-2", "Hello", dear, timeout=30)
        assert err.value.reason == "too costly per step", err.value
        neighbour.release(neighbour.call(add, "step-live-3", "Hello", {**greedy(400), "bad_words": ["!"] * 100},
                                         timeout=30))
    assert bridge.release(held) == 1                                   # aborted: room again
    room_again(lambda: bridge.release(bridge.call(add, "step-live-4", "Hello", dear, timeout=30)),
               "too costly per step")


def test_the_items_a_request_has_the_engine_core_hold_are_bounded(bridge: BridgeClient) -> None:
    """vLLM sends each of a request's n completions to the engine core with a copy of its params: 999,000
    allowed token ids at n=256 (2 MB) took the core from 4.4 to 10 GB, kept, and held every client's
    requests 33 s. n x the items of a request's lists and maps is at most 2,000,000. The request's id,
    trace headers and cache salt, copied with each completion too, are bounded in length."""
    many = {**greedy(4), "temperature": 0.8, "n": 256}
    for field, value in (("allowed_token_ids", [i % 1000 for i in range(8_000)]),
                         ("extra_args", {"k": list(range(8_000))})):
        with pytest.raises(CallError) as err:
            list(bridge.stream(GENERATE, "Hello", {**many, field: value}, f"items-{field}", timeout=60))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many items", err.value
        assert err.value.detail is not None and err.value.detail.parameter == f"sampling_params.{field}", err.value
        assert "comes to at least 2,0" in err.value.details, err.value
    fits = {**many, "n": 64, "allowed_token_ids": list(range(1000))}     # 64,000
    assert list(bridge.stream(GENERATE, "Hello", fits, "items-fit", timeout=120))[-1]["finished"]
    with pytest.raises(CallError) as err:      # copied with each completion too, tracing or not
        list(bridge.stream(GENERATE, "Hello", greedy(2), "items-trace", kwargs={"trace_headers": {"h": "a" * 10_000}},
                           timeout=60))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.detail is not None, err.value
    assert err.value.detail.parameter == "trace_headers" and "10,001 characters" in err.value.details, err.value
    with pytest.raises(CallError) as err:      # the id too: copied into each completion's id and every output
        list(bridge.stream(GENERATE, "Hello", greedy(2), "r" * 1_025, timeout=60))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None, err.value
    assert err.value.detail.parameter == "request_id" and "1,025 characters" in err.value.details, err.value
    with pytest.raises(CallError) as err:      # and the prompt's cache salt
        list(bridge.stream(GENERATE, {"prompt": "Hello", "cache_salt": "s" * 1_025}, many, "items-salt", timeout=60))
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None, err.value
    assert err.value.detail.parameter == "prompt.cache_salt" and "got 1,025 characters" in err.value.details, err.value
    salted = {"prompt": "Hello", "cache_salt": "s" * 1_024}
    assert list(bridge.stream(GENERATE, salted, greedy(2), "items-salt-fits", timeout=60))[-1]["finished"]


def test_one_client_takes_at_most_three_quarters_of_its_hosts_sequences(engine_worker: WorkerProcess,
                                                                        bridge: BridgeClient) -> None:
    """A shared engine holds at most max_live_sequences live (400 queued requests of n=256 took 416 MB
    of its core), of which a host takes three quarters of what the other hosts leave; and one
    connection filling its host's share shut out a bystander on the same address: a client takes at
    most three quarters of what its host's others leave. Here: 2,048, a host 1,536, a client 1,152."""
    add = Target.method("engine", "add_request")
    wide = {**greedy(1000), "n": 64, "temperature": 0.8}
    held = []
    try:
        for i in range(18):                                        # 1,152 sequences: three quarters of 1,536
            held.append(bridge.call(add, f"wide-{i}", "Hello", wide, timeout=60))
        with pytest.raises(CallError) as err:
            bridge.call(add, "wide-over", "Hello", wide, timeout=60)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "too many sequences"
        assert re.search(r"this client holds 1,152 sequences there, its host 1,152 and the engine 1,[0-9]{3} in all",
                         err.value.details), err.value
        assert f"the engine's limit of {MAX_LIVE:,} live sequences (max_live_sequences" in err.value.details
        own = [("grpc.use_local_subchannel_pool", 1)]
        with BridgeClient(engine_worker.address, channel_options=own) as neighbour:
            neighbour.release(neighbour.call(add, "wide-neighbour", "Hello", wide, timeout=60))
    finally:
        bridge.release(*held)


def test_releasing_an_add_request_collector_ends_its_request(engine_worker: WorkerProcess,
                                                              bridge: BridgeClient) -> None:
    """Nobody can read a request whose collector's last ref is gone: it is aborted (children and
    all), where it ran on to its last token before (30 of n=256 kept an engine busy 5 minutes)."""
    collector = bridge.call(Target.method("engine", "add_request"), "released-collector", "Hello",
                            {**greedy(1900), "n": 2, "temperature": 0.8}, timeout=30)
    assert isinstance(collector, pb.Ref) and "Collector" in collector.type_name, collector
    time.sleep(0.3)
    assert bridge.release(collector) == 1
    deadline = time.monotonic() + 10
    while "Aborted request(s) released-collector-" not in engine_worker.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the released collector's request was not aborted"
        time.sleep(0.1)
    assert list(bridge.stream(GENERATE, "Hello", greedy(2), "after-released"))[-1]["finished"] is True


def test_a_light_client_is_not_queued_behind_a_heavy_clients_sequences(engine_worker: WorkerProcess) -> None:
    """On a published engine that schedules by priority, each request's priority is the sequences its
    client runs there: a light client's request goes ahead of a heavy client's queue instead of
    waiting behind all of it, as it did in order of arrival. Heavy: three requests of 16 sequences
    (the engine runs 16 at once); light: one sequence, sent once the heavy ones are queued."""
    import threading
    heavy_params = {**greedy(600), "n": 16, "temperature": 0.8}   # a batch of ~2 s here
    first_item: dict[str, float] = {}
    ended: dict[str, float] = {}

    def run(client: BridgeClient, tag: str, params: dict[str, Any]) -> None:
        for item in client.stream(GENERATE, "Hello", params, tag, timeout=120):
            first_item.setdefault(tag, time.monotonic())
        ended[tag] = time.monotonic()

    own = [("grpc.use_local_subchannel_pool", 1)]      # a connection of its own: two clients, not one
    with BridgeClient(engine_worker.address) as heavy, \
            BridgeClient(engine_worker.address, channel_options=own) as light:
        runners = [threading.Thread(target=run, args=(heavy, f"heavy-{i}", heavy_params)) for i in range(3)]
        for runner in runners:
            runner.start()
            time.sleep(0.2)       # in this order
        run(light, "light", greedy(4))
        for runner in runners:
            runner.join(120)
    assert set(ended) == {"heavy-0", "heavy-1", "heavy-2", "light"}, ended
    # In order of arrival the light request waited for heavy-1's and heavy-2's batches after heavy-0's;
    # ranked, it runs beside heavy-1's, which had not begun when it came
    assert first_item["light"] < ended["heavy-1"], (first_item, ended)
