"""A fuzz suite: random and mutated requests of every RPC, through the pool server and straight to a
worker, Multiplex included. Afterwards every call must have been answered before its deadline, no
worker may have restarted or replaced its engine, health must say SERVING, and a greedy generation
must give the same tokens as it did on the fresh server.

Requests come from hypothesis: raw bytes; valid requests with their bytes flipped, cut or spliced;
and well-formed requests of random targets (the catalog's names, members, kinds this server does not
know), random receivers, random typed values (deep, huge, non-finite, refs that do not exist, records
of any type name, tensors whose bytes do not match their shape) and random runtime options. The
targets a well-behaved client could use to stop the shared engine (shutdown, sleep, pause, ...) are
left out: their effect is not a failure, and `test_resilience.py` covers recovery from them.
"""

from __future__ import annotations

import collections
import os
import time
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from bridge_server.client.client import BridgeClient, Target
from tests.pool.harness import PoolServer
from vllm_bridge.v1 import bridge_pb2 as pb

EXAMPLES = int(os.environ.get("VLLM_BRIDGE_FUZZ_EXAMPLES", "6000"))   # about 45 s here
DEADLINE_S = 5.0
SLACK_S = 2.0            # an answer must come within the deadline plus this
GENERATE = Target.method("engine", "generate")
# What a fuzzer could use to stop the shared engine on purpose: not a failure when it happens.
DISRUPTIVE = ("shutdown", "sleep", "pause_generation", "collective_rpc", "scale_elastic_ep", "wait_for_requests",
              "start_profile", "stop_profile", "init_", "destroy_", "cleanup_", "stateless_", "graph_capture",
              "initialize_model_parallel", "ensure_model_parallel", "add_request", "_add_request",
              "_run_output_handler", "abort")


@pytest.fixture(scope="module")
def server(stranger_server: PoolServer) -> PoolServer:
    return stranger_server


@pytest.fixture(scope="module")
def names(server: PoolServer) -> list[str]:
    with BridgeClient(server.address) as c:
        catalog = c.describe()
    return [e.name for e in catalog.entries if not any(d in e.name for d in DISRUPTIVE)]


def tokens(address: str, request_id: str) -> list[int]:
    with BridgeClient(address, options=None) as c:
        items = list(c.stream(GENERATE, "The quick brown fox", {"temperature": 0.0, "max_tokens": 16,
                                                                "ignore_eos": True}, request_id,
                              pool="e", timeout=30))
    return list(items[-1]["outputs"][0]["token_ids"])


# ------------------------------------------------------------------------------------------ values
SCALARS = st.one_of(
    st.just(pb.Value(null=pb.Null())), st.booleans().map(lambda b: pb.Value(bool=b)),
    st.integers(-(2**63), 2**63 - 1).map(lambda i: pb.Value(int=i)),
    st.text(alphabet="-0123456789_+ x", max_size=40).map(lambda s: pb.Value(big_int=s)),
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: pb.Value(float=f)),
    st.text(max_size=60).map(lambda s: pb.Value(str=s)), st.binary(max_size=60).map(lambda b: pb.Value(bytes=b)),
    st.text(max_size=20).map(lambda s: pb.Value(atom=s)),
    st.lists(st.integers(-(2**63), 2**63 - 1), max_size=30).map(lambda xs: pb.Value(ints=pb.Ints(values=xs))),
    st.builds(lambda d, shape, data: pb.Value(tensor=pb.Tensor(dtype=d, shape=shape, data=data)),
              st.sampled_from(["float32", "int64", "bool", "bfloat16", "float8_e4m3fn", "complex64", "qint8",
                               "nope", ""]),
              st.lists(st.integers(-3, 5), max_size=4), st.binary(max_size=64)),
    st.builds(lambda i, s: pb.Value(ref=pb.Ref(id=i, session_id=s)),
              st.sampled_from(["", "e-0-g1.nope", "p-0-g1.x", "w1.y", "..", "x" * 300]), st.text(max_size=10)),
    st.builds(lambda t, n: pb.Value(enum=pb.Enum(type_name=t, name=n)),
              st.sampled_from(["vllm.sampling_params.RequestOutputKind", "vllm.config.compilation.CUDAGraphMode",
                               "enum.Enum", "os.Nope", ""]), st.text(max_size=10)),
)


def containers(children: st.SearchStrategy[pb.Value]) -> st.SearchStrategy[pb.Value]:
    items = st.lists(children, max_size=5).map(lambda xs: pb.Items(items=xs))
    entries = st.lists(st.tuples(children, children), max_size=4).map(
        lambda kvs: pb.Map(entries=[pb.Entry(key=k, value=v) for k, v in kvs]))
    fields = st.lists(st.tuples(st.text(max_size=12), children), max_size=5).map(
        lambda fs: [pb.Field(name=n, value=v) for n, v in fs])
    return st.one_of(
        items.map(lambda i: pb.Value(list=i)), items.map(lambda i: pb.Value(tuple=i)),
        items.map(lambda i: pb.Value(set=i)), items.map(lambda i: pb.Value(frozenset=i)),
        entries.map(lambda m: pb.Value(map=m)),
        st.builds(lambda t, fs: pb.Value(record=pb.Record(type_name=t, fields=fs)),
                  st.sampled_from(["vllm.sampling_params.SamplingParams", "vllm.config.ParallelConfig",
                                   "vllm.lora.request.LoRARequest", "builtins.dict", "os.system", ""]), fields),
        # what a client means by a map where a record is built: sampling params with odd values
        st.lists(st.tuples(st.sampled_from(["max_tokens", "temperature", "top_p", "n", "stop", "seed", "logprobs",
                                            "output_kind", "structured_outputs", "nope"]), children), max_size=4)
        .map(lambda kvs: pb.Value(map=pb.Map(entries=[pb.Entry(key=pb.Value(str=k), value=v) for k, v in kvs]))),
    )


VALUES = st.recursive(SCALARS, containers, max_leaves=12)


# ------------------------------------------------------------------------------------------ requests
@st.composite
def targets(draw: st.DrawFn, names: list[str]) -> pb.Target:
    kind = draw(st.sampled_from([0, 1, 2, 3, 4, 5, 6, 7, 99]))
    name = draw(st.one_of(st.sampled_from(names), st.sampled_from(["generate", "encode", "get_tokenizer",
                                                                   "__class__", "__init__", "__dict__", "errored",
                                                                   "tokenizer", "engine_core", "_private"]),
                          st.text(max_size=30)))
    target = pb.Target(kind=kind, name=name)
    receiver = draw(st.sampled_from(["none", "engine", "object", "ref"]))
    if receiver == "engine":
        target.object = "engine"
    elif receiver == "object":
        target.object = draw(st.text(max_size=20))
    elif receiver == "ref":
        target.ref.id = draw(st.sampled_from(["e-0-g1.nope", "w9.x", "", "p-0-g1." + "z" * 24]))
    return target


@st.composite
def call_requests(draw: st.DrawFn, names: list[str]) -> pb.CallRequest:
    return pb.CallRequest(target=draw(targets(names)), args=draw(st.lists(VALUES, max_size=4)),
                          kwargs=draw(st.dictionaries(st.text(max_size=12), VALUES, max_size=3)))


GOOD = [pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.divide"),
                       args=[pb.Value(int=6), pb.Value(int=3)]).SerializeToString(),
        pb.CallRequest(target=pb.Target(kind=pb.Target.METHOD, name="generate", object="engine"),
                       args=[pb.Value(str="Hi"), pb.Value(map=pb.Map(entries=[pb.Entry(
                           key=pb.Value(str="max_tokens"), value=pb.Value(int=2))])), pb.Value(str="g")]
                       ).SerializeToString()]


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(GOOD)))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert", "dup"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if op == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif op == "cut":
            del data[at:]
        elif op == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        else:
            data += data[at:]
    return bytes(data)


METADATA = st.lists(st.tuples(
    st.sampled_from(["x-bridge-session", "x-bridge-timeout-profile", "x-bridge-timeout-ms", "x-bridge-stream-timeout-ms",
                     "x-bridge-stream-interval-ms", "x-bridge-pool", "x-bridge-affinity", "x-bridge-refs",
                     "x-bridge-rank", "x-bridge-collective", "x-bridge-other"]),
    st.one_of(st.sampled_from(["", "-5", "0", "1e400", "nan", "inf", "e", "p", "hint", "strict_fail_fast",
                               "batch_job", "99999999999999999999", "e-0-g1.x,p-0-g1.y"]),
              st.text(alphabet=st.characters(min_codepoint=32, max_codepoint=126), max_size=30))), max_size=4)


@st.composite
def cases(draw: st.DrawFn, names: list[str]) -> tuple[str, str, bytes | list[bytes], list[tuple[str, str]]]:
    rpc = draw(st.sampled_from(["Call", "Stream", "Collective", "Release", "Describe", "Multiplex"]))
    where = draw(st.sampled_from(["pool", "worker"]))
    shape = draw(st.sampled_from(["random", "mutated", "structured", "structured"]))

    def payload() -> bytes:
        if shape == "random":
            return draw(st.binary(max_size=200))
        if shape == "mutated":
            return draw(mutated())
        return draw(call_requests(names)).SerializeToString()

    if rpc == "Multiplex":
        requests: list[bytes] = []
        for i in range(draw(st.integers(1, 4))):
            choice = draw(st.sampled_from(["start", "cancel", "credit", "raw"]))
            if choice == "start":
                requests.append(pb.MuxRequestView(start=pb.MuxStartView(
                    id=draw(st.integers(0, 5)), call=payload(), stream=draw(st.booleans()),
                    window=draw(st.integers(0, 3)), time_left_ms=draw(st.floats(-10, 1e4)))).SerializeToString())
            elif choice == "cancel":
                requests.append(pb.MuxRequest(cancel=draw(st.integers(0, 5))).SerializeToString())
            elif choice == "credit":
                requests.append(pb.MuxRequest(credit=pb.MuxCredit(id=draw(st.integers(0, 5)),
                                                                  events=draw(st.integers(0, 2**32 - 1)))
                                              ).SerializeToString())
            else:
                requests.append(draw(st.binary(max_size=100)))
        body: bytes | list[bytes] = requests
    elif rpc == "Collective":
        body = pb.CollectiveRequestView(call=payload()).SerializeToString() if shape != "random" else payload()
    elif rpc == "Release":
        body = (pb.ReleaseRequest(ref_ids=draw(st.lists(st.text(max_size=30), max_size=3)),
                                  session_id=draw(st.text(max_size=10))).SerializeToString()
                if shape == "structured" else payload())
    elif rpc == "Describe":
        body = pb.DescribeRequest(prefix=draw(st.text(max_size=10))).SerializeToString() if shape == "structured" \
            else payload()
    else:
        body = payload()
    return rpc, where, body, draw(METADATA)


# ------------------------------------------------------------------------------------------ the suite
def send(channel: grpc.Channel, rpc: str, body: bytes | list[bytes], md: list[tuple[str, str]],
         events: collections.Counter[str], internal: list[str]) -> str:
    """The call's status; events of a Multiplex are counted in `events`, and what every INTERNAL said
    goes into `internal` (the fuzz is not replayable: the failure message must say enough)."""
    method = f"/vllm_bridge.v1.Bridge/{rpc}"
    try:
        if rpc == "Multiplex":
            assert isinstance(body, list)
            for raw in channel.stream_stream(method)(iter(body), timeout=DEADLINE_S, metadata=md):
                for event in pb.MuxReply.FromString(raw).events:
                    kind = event.WhichOneof("kind")
                    code = grpc.StatusCode.OK.name if kind != "error" else next(
                        (c.name for c in grpc.StatusCode if c.value[0] == event.error.code), "?")
                    events[f"Multiplex event {kind} {code}"] += 1
                    if code == "INTERNAL":
                        internal.append(f"Multiplex event: {event.error.message}")
        elif rpc == "Stream":
            for _ in channel.unary_stream(method)(body, timeout=DEADLINE_S, metadata=md):
                pass
        else:
            channel.unary_unary(method)(body, timeout=DEADLINE_S, metadata=md)
    except grpc.RpcError as err:
        if err.code() == grpc.StatusCode.INTERNAL:   # type: ignore[attr-defined]
            internal.append(f"{rpc}: {err.details()}")   # type: ignore[attr-defined]
        return err.code().name   # type: ignore[attr-defined]
    return "OK"


def test_fuzz_every_rpc_through_the_pool_and_straight_to_a_worker(server: PoolServer, names: list[str]) -> None:
    fresh = tokens(server.address, "fuzz-before")
    worker = server.pool("e").workers[0]
    restarts = server.pool("e").restarts
    channels = {"pool": grpc.insecure_channel(server.address), "worker": grpc.insecure_channel(worker.address)}
    statuses: collections.Counter[str] = collections.Counter()
    slow: list[tuple[float, Any]] = []
    internal: list[str] = []
    cases_of_internal: list[Any] = []

    @settings(max_examples=EXAMPLES, deadline=None, phases=[Phase.generate], database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=cases(names))
    def run(case: tuple[str, str, bytes | list[bytes], list[tuple[str, str]]]) -> None:
        rpc, where, body, md = case
        t0, seen = time.monotonic(), len(internal)
        code = send(channels[where], rpc, body, md, statuses, internal)
        took = time.monotonic() - t0
        statuses[f"{rpc} {code}"] += 1
        if len(internal) > seen:
            cases_of_internal.append((where, rpc, body, md))
        if took > DEADLINE_S + SLACK_S:
            slow.append((took, case))

    started = time.monotonic()
    try:
        run()
    finally:
        for ch in channels.values():
            ch.close()
    took = time.monotonic() - started
    print(f"\nfuzz: {sum(statuses.values())} cases in {took:.1f} s; by RPC and status:")
    for key, n in sorted(statuses.items()):
        print(f"  {key}: {n}")
    assert not slow, f"answered late: {slow[:3]}"
    assert not internal, (internal[:3], cases_of_internal[:3])
    pool = server.pool("e")
    # the pool is shared with the resilience tests, which break the engine on purpose: count from here
    assert pool.restarts == restarts and pool.workers[0].pid == worker.pid \
        and pool.workers[0].replaced == worker.replaced, pool
    assert all(server.pool(p).state == "serving" for p in ("e", "p"))
    with grpc.insecure_channel(server.address) as ch:
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
            health_pb2.HealthCheckResponse.SERVING
    assert tokens(server.address, "fuzz-after") == fresh

