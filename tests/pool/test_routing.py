"""The router end to end: pools, affinity, refs under load, the queue, deadlines, health, status,
metrics. One real `vllm-bridge serve` with four real worker processes serves the whole module.

Pool `a` has two workers that run one call each, so one slow call makes a worker busy; pool `b` has
two workers with room for load.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_status import rpc_status

from bridge_server.client.client import CallError, Target
from tests.conftest import ROOT, large_requests, multiplex_batches
from tests.pool.harness import Gate, PoolServer, in_thread, open_gates, start_pool_server, wait_until
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

CONFIG = """
grace_s = 10
[[pools]]
name = "a"
workers = 2
max_concurrent = 1
queue_size = 2
affinity = "hint"

[[pools]]
name = "b"
workers = 2
max_concurrent = 4
queue_size = 512
"""

PC = "vllm.config.ParallelConfig"
DIVIDE = "vllm.distributed.divide"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    s = start_pool_server(tmp_path_factory.mktemp("pool-routing"), CONFIG, metrics=True)
    yield s
    s.stop()


def holder(ref: object) -> str:
    """The worker that made a ref (ParallelConfig comes back as a ref: it tells where a call ran)."""
    return ref.worker_id  # type: ignore[attr-defined]


def idle(server: PoolServer, pool: str) -> None:
    wait_until(lambda: (p := server.pool(pool)).in_flight == 0 and p.queue_length == 0, what=f"pool {pool} idle")


def test_calls_are_routed_by_pool_name_and_an_unknown_pool_lists_the_pools(server: PoolServer) -> None:
    with server.client() as c:
        ran_on = {holder(c.call(PC, pool=p, session_id=f"route-{p}-{i}")) for p in ("a", "b") for i in range(4)}
        assert {w.split("-")[0] for w in ran_on} == {"a", "b"}
        assert all(w.startswith(("a-", "b-")) and "." not in w for w in ran_on)
        assert c.call(DIVIDE, 12, 4, pool="b") == 3
        with pytest.raises(CallError) as err:
            c.call(DIVIDE, 1, 1, pool="nope")
        assert err.value.code == grpc.StatusCode.NOT_FOUND
        assert "no pool 'nope'; pools: a, b" in err.value.details
        assert err.value.category == "pool" and err.value.reason == "unknown pool"
        # the pool status service answers NOT_FOUND too, whatever the name's length (echoed whole, a
        # 10,000-character name's status passed gRPC's header limit: RESOURCE_EXHAUSTED instead)
        from vllm_bridge.v1 import pool_pb2 as ppb
        from vllm_bridge.v1 import pool_pb2_grpc as ppb_grpc
        for name in ("nope", "n" * 10_000):
            with pytest.raises(grpc.RpcError) as rpc_err:
                ppb_grpc.PoolStub(c.channel).Status(ppb.StatusRequest(pool=name), timeout=10)
            assert rpc_err.value.code() == grpc.StatusCode.NOT_FOUND, rpc_err.value   # type: ignore[attr-defined]
            assert "pools: a, b" in rpc_err.value.details()   # type: ignore[attr-defined]
        # (a request of the open services is at most 16 KiB: it names a pool)
        with pytest.raises(grpc.RpcError) as rpc_err:
            ppb_grpc.PoolStub(c.channel).Status(ppb.StatusRequest(pool="n" * 20_000), timeout=10)
        assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, rpc_err.value   # type: ignore[attr-defined]
        assert "over the limit of 16,384" in rpc_err.value.details()   # type: ignore[attr-defined]
        # x-bridge-rank picks the worker of that slot.
        assert [holder(c.call(PC, pool="a", rank=r)) for r in (1, 0, 1)] == ["a-1-g1", "a-0-g1", "a-1-g1"]
        # A session first seen in a call to a rank is pinned there (its refs are there): its next
        # calls without a rank go there too (unpinned, new sessions would spread over both workers).
        ranked = [f"ranked-{i}" for i in range(4)]
        assert {holder(c.call(PC, pool="a", rank=1, session_id=s)) for s in ranked} == {"a-1-g1"}
        assert {holder(c.call(PC, pool="a", session_id=s)) for s in ranked for _ in range(2)} == {"a-1-g1"}
        with pytest.raises(CallError) as err:
            c.call(PC, pool="a", rank=2)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "no rank 2" in err.value.details
        # The worker's own errors come back unchanged: status, details and the rich ErrorDetail.
        with pytest.raises(CallError) as err:
            c.call(DIVIDE, 1, 0, pool="b")
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail is not None
        assert err.value.detail.python_type == "ZeroDivisionError" and err.value.category == "python_error"
        # Streams are forwarded item by item, and the catalog comes from a worker.
        assert list(c.stream("vllm.distributed.get_pp_indices", 64, 1, 4, pool="b")) == [16, 32]
        assert any(e.name == DIVIDE for e in c.describe("vllm.distributed").entries)


def test_each_affinity_mode_when_the_pinned_worker_is_busy(server: PoolServer) -> None:
    idle(server, "a")
    gate = Gate()
    with server.client(pool="a", session_id="aff") as c:
        pinned = holder(c.call(PC))
        ref = c.call(PC)                               # held by the pinned worker
        assert holder(ref) == pinned
        busy = in_thread(lambda: c.call(*gate.args(), affinity="strict_queue"))
        wait_until(lambda: {w.id: w.in_flight for w in server.pool("a").workers}.get(pinned) == 1, what="pinned busy")
        # hint: runs on the other worker at once.
        other = holder(c.call(PC, affinity="hint"))
        assert other != pinned and other.startswith("a-")
        # strict_fail_fast: fails at once, naming the reason.
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            c.call(PC, affinity="strict_fail_fast")
        assert time.monotonic() - t0 < 0.5
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "worker busy"
        assert err.value.category == "pool" and pinned in err.value.details
        # A ref call under strict_fail_fast fails fast too (it can only run where the ref is).
        with pytest.raises(CallError) as err:
            c.call(Target.get(ref, "world_size"), affinity="strict_fail_fast")
        assert err.value.reason == "worker busy" and ref.id in err.value.details
        # strict_queue waits for the pinned worker; so does a ref call under hint.
        queued = in_thread(lambda: c.call(PC, affinity="strict_queue"))
        via_ref = in_thread(lambda: c.call(Target.get(ref, "world_size"), affinity="hint"))
        wait_until(lambda: server.pool("a").queue_length == 2, what="two calls queued")
        time.sleep(0.3)
        assert not queued.done.is_set() and not via_ref.done.is_set()
        released = time.monotonic()
        open_gates([gate])
        for out in (busy, queued, via_ref):
            assert out.done.wait(30) and out.error is None, out.error
        assert holder(queued.value) == pinned and queued.ended >= released
        assert via_ref.value == 1


def test_ref_calls_under_load_always_reach_the_worker_holding_the_ref(server: PoolServer) -> None:
    idle(server, "b")
    with server.client(pool="b") as c:
        # Refs on both workers, and sessions pinned to the *other* worker than their refs.
        refs = []
        for i in range(8):
            r = c.call(PC, kwargs={"data_parallel_size": i + 1}, session_id=f"load-ref-{i}")
            refs.append(r)
        assert len({holder(r) for r in refs}) == 2

        def one(i: int) -> tuple[int, int]:
            ref = refs[i % len(refs)]
            mode = ("hint", "strict_queue")[i % 2]
            got = c.call(Target.get(ref, "data_parallel_size"), affinity=mode, session_id=f"load-{i % 5}")
            c.call("vllm.distributed.get_pp_indices", 64, i % 4, 4, session_id=f"load-{i % 5}", affinity="hint")
            return got, refs.index(ref) + 1

        with ThreadPoolExecutor(24) as ex:
            results = list(ex.map(one, range(400)))
    assert all(got == want for got, want in results)


def test_a_call_on_a_ref_reaches_its_worker_without_any_metadata_from_the_client(server: PoolServer) -> None:
    """A stranger's client sends only the request: the refs it carries (the receiver, an argument)
    route it, over Call, Stream and Multiplex alike."""
    idle(server, "b")
    refs = []
    for i in range(8):          # new sessions spread over both workers of the pool
        with server.client(pool="b", session_id=f"no-md-{i}") as c:
            refs.append(c.call(PC, kwargs={"data_parallel_size": i + 1}))
    assert len({holder(r) for r in refs}) == 2
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary("/vllm_bridge.v1.Bridge/Call")
        stream = ch.unary_stream("/vllm_bridge.v1.Bridge/Stream")
        for i, ref in enumerate(refs):
            plain = ref.__class__(id=ref.id)     # only the id: no worker, no session
            get = pb.CallRequest(target=pb.Target(kind=pb.Target.GET_ATTR, name="data_parallel_size", ref=plain))
            md = (("x-bridge-pool", "b"),)
            reply = pb.CallReply.FromString(call(get.SerializeToString(), metadata=md, timeout=10))
            assert reply.value.int == i + 1
            as_arg = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION,
                                                     name="vllm.forward_context.DPMetadata.make"),
                                    args=[pb.Value(ref=plain), pb.Value(int=7), pb.Value(list=pb.Items())])
            with pytest.raises(grpc.RpcError) as err:   # vLLM's own error: the call reached the ref's worker
                list(stream(as_arg.SerializeToString(), metadata=md, timeout=10))
            assert err.value.code() != grpc.StatusCode.NOT_FOUND, err.value.details()   # type: ignore[attr-defined]


def test_refs_listed_in_the_header_that_no_worker_holds_are_refused_by_the_headers_name(server: PoolServer) -> None:
    """x-bridge-refs names refs the call uses: an entry that is no ref id, or a ref of no worker of
    this server, is refused as the header's, not as a ref of the request or as refs of two workers."""
    divide = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name=DIVIDE), args=[pb.Value(int=6),
                                                                                          pb.Value(int=3)])
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary("/vllm_bridge.v1.Bridge/Call")
        for listed, code, said in (("a,b", grpc.StatusCode.INVALID_ARGUMENT, "'a' is not a ref id"),
                                   (" nodot ", grpc.StatusCode.INVALID_ARGUMENT, "'nodot' is not a ref id"),
                                   (".x", grpc.StatusCode.INVALID_ARGUMENT, "'.x' is not a ref id"),
                                   ("zz-0-g1.tok", grpc.StatusCode.NOT_FOUND,
                                    "ref 'zz-0-g1.tok' (in x-bridge-refs): no worker 'zz-0-g1' in this server")):
            with pytest.raises(grpc.RpcError) as err:
                call(divide.SerializeToString(), metadata=(("x-bridge-refs", listed),), timeout=10)
            status = rpc_status.from_call(err.value)
            assert status is not None and err.value.code() == code, err.value   # type: ignore[attr-defined]
            detail = pb.ErrorDetail()
            assert status.details[0].Unpack(detail) and detail.parameter == "x-bridge-refs", detail
            assert said in err.value.details(), err.value.details()     # type: ignore[attr-defined]
        with server.client(pool="b", session_id="listed") as c:
            held = c.call(PC, kwargs={"data_parallel_size": 1})
        both = f"{held.id},zz-0-g1.y"
        with pytest.raises(grpc.RpcError) as err:
            call(divide.SerializeToString(), metadata=(("x-bridge-refs", both),), timeout=10)
        assert "held by different workers" in err.value.details(), err.value.details()   # type: ignore[attr-defined]
        reply = pb.CallReply.FromString(call(divide.SerializeToString(), metadata=(("x-bridge-refs", " , ,"),),
                                             timeout=10))
        assert reply.value.float == 2.0 or reply.value.int == 2, reply
        # a request's own ref that is no ref id: refused by the pool server as such (it was NOT_FOUND,
        # "no worker 'nodot'", or from a worker "not held by worker ...")
        on_it = pb.CallRequest(target=pb.Target(kind=pb.Target.METHOD, name="x", ref=pb.Ref(id="nodot")))
        with pytest.raises(grpc.RpcError) as err:
            call(on_it.SerializeToString(), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()   # type: ignore[attr-defined]
        assert "'nodot' is not a ref id" in err.value.details(), err.value.details()   # type: ignore[attr-defined]


def test_a_ref_deep_in_a_large_request_reaches_its_worker(server: PoolServer) -> None:
    """The pool server reads a request of 256 KiB or more only in part (its first 256 KiB of
    arguments): a ref inside a larger argument is found in its bytes by its worker's id."""
    idle(server, "b")
    refs = []
    for i in range(8):
        with server.client(pool="b", session_id=f"deep-{i}") as c:
            refs.append(c.call(PC, kwargs={"data_parallel_size": i + 1}))
    assert len({holder(r) for r in refs}) == 2
    with grpc.insecure_channel(server.address) as ch:
        call = ch.unary_unary("/vllm_bridge.v1.Bridge/Call")
        for ref in refs:
            deep = pb.Value(list=pb.Items(items=[pb.Value(str="x" * 300_000), pb.Value(ref=ref.__class__(id=ref.id))]))
            request = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name=f"{DIVIDE}"), args=[deep, deep])
            with pytest.raises(grpc.RpcError) as err:     # divide takes numbers: refused once its refs resolve
                call(request.SerializeToString(), metadata=(("x-bridge-pool", "b"),), timeout=10)
            code, details = err.value.code(), err.value.details()   # type: ignore[attr-defined]
            # the worker's own refusal, past its refs: they reached it (not "not a ref id", nor NOT_FOUND
            # from a worker that does not hold them)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "parameter numerator" in details, details


def _hold_both_workers(server: PoolServer, c: Any) -> tuple[list[Gate], list[Any]]:
    """Both workers of pool `a` held by a gate each, both gates' rendezvous listening. A gate whose
    port another process took meanwhile (`free_port` closes it before the worker binds it) fails at
    once and frees its worker: such a hold is opened and tried again with new ports."""
    for attempt in range(3):
        gates = [Gate(), Gate()]
        busy = [in_thread(lambda g=g, i=i: c.call(*g.args(), session_id=f"q-busy-{attempt}-{i}"))
                for i, g in enumerate(gates)]
        wait_until(lambda: all(g.running() for g in gates) and server.pool("a").in_flight == 2
                   or any(b.done.is_set() for b in busy), what="both workers held")
        if not any(b.done.is_set() for b in busy):
            return gates, busy
        open_gates([g for g, b in zip(gates, busy) if not b.done.is_set()])     # (a failed one has no rank 0)
        for b in busy:
            b.done.wait(30)
        idle(server, "a")
    pytest.fail("a gate failed three times in a row")


def test_a_full_queue_and_a_deadline_that_expires_in_the_queue(server: PoolServer) -> None:
    idle(server, "a")
    with server.client(pool="a") as c:
        gates, busy = _hold_both_workers(server, c)
        # A deadline that passes while the call waits for a slot: the gRPC deadline, then the bridge option.
        for kw in ({"timeout": 0.5}, {"timeout_s": 0.5}):
            t0 = time.monotonic()
            with pytest.raises(CallError) as err:
                c.call(DIVIDE, 4, 2, session_id="q-deadline", **kw)
            waited = time.monotonic() - t0
            assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, err.value
            assert err.value.category == "timeout" and "queue" in err.value.details
            assert 0.4 < waited < 1.5
        # Two calls fill the queue (queue_size 2); the third is refused at once.
        queued = [in_thread(lambda i=i: c.call(DIVIDE, 8, 2, session_id=f"q-wait-{i}")) for i in range(2)]
        wait_until(lambda: server.pool("a").queue_length == 2, what="queue full")
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            c.call(DIVIDE, 8, 2, session_id="q-refused")
        assert time.monotonic() - t0 < 0.5
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "queue full"
        assert server.pool("a").queue_length == 2
        open_gates(gates)
        for out in busy + queued:
            assert out.done.wait(30) and out.error is None, out.error
        assert [q.value for q in queued] == [4, 4]


def test_the_callers_deadline_and_cancellation_cross_the_router(server: PoolServer) -> None:
    idle(server, "b")
    gates = [Gate(), Gate(), Gate()]
    with server.client(pool="b") as c:
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            c.call(*gates[0].args(), timeout=1.0)       # the worker enforces it: the call is running there
        assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 2
        wait_until(lambda: server.pool("b").in_flight == 0, timeout=2, what="the slot freed")
        request, _ = c.request(gates[1].args()[0], gates[1].args()[1:])
    with grpc.insecure_channel(server.address) as ch:
        future = ch.unary_unary("/vllm_bridge.v1.Bridge/Call").future(
            request.SerializeToString(), metadata=[("x-bridge-pool", "b")])
        wait_until(gates[1].running, what="the call running in the worker")
        future.cancel()
        wait_until(lambda: server.pool("b").in_flight == 0, timeout=2, what="the cancelled call's slot freed")
        request.args[1].int = gates[2].port
        stream = ch.unary_stream("/vllm_bridge.v1.Bridge/Stream")(
            request.SerializeToString(), metadata=[("x-bridge-pool", "b")])
        wait_until(gates[2].running, what="the stream running in the worker")
        assert server.pool("b").in_flight == 1
        stream.cancel()
        wait_until(lambda: server.pool("b").in_flight == 0, timeout=2, what="the cancelled stream's slot freed")
    open_gates(gates)    # the worker's threads were abandoned in C code: let them finish


def test_health_per_pool(server: PoolServer) -> None:
    with grpc.insecure_channel(server.address) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for service in ("", "vllm_bridge.v1.Bridge", "pool/a", "pool/b"):
            assert stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING, service
        with pytest.raises(grpc.RpcError) as err:
            stub.Check(health_pb2.HealthCheckRequest(service="pool/nope"), timeout=5)
        assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_status_rpc_and_cli(server: PoolServer) -> None:
    with server.client(pool="b", session_id="status-s") as c:
        c.call(PC)
    reply = server.status()
    assert reply.state == "serving" and [p.name for p in reply.pools] == ["a", "b"]
    b = reply.pools[1]
    assert b.state == "serving" and b.max_concurrent == 4 and b.queue_capacity == 512 and b.sessions >= 1
    assert [w.id for w in b.workers] == ["b-0-g1", "b-1-g1"]
    assert all(w.state == "ready" and w.pid > 0 and w.address.startswith("unix:") for w in b.workers)
    assert sum(w.calls for w in b.workers) > 0 and max(w.refs for w in b.workers) >= 1
    out = subprocess.run([sys.executable, "-m", "bridge_server.cli", "status", "--address", server.address],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert {p["name"] for p in data["pools"]} == {"a", "b"}
    w = data["pools"][0]["workers"][0]
    assert {"id", "pid", "state", "in_flight", "calls", "sessions", "refs", "restarts"} <= set(w)
    assert isinstance(w["calls"], int) and isinstance(w["pid"], int)


def test_prometheus_metrics_are_served(server: PoolServer) -> None:
    with server.client(pool="b") as c:
        c.call(DIVIDE, 6, 3)
    needles = ('vllm_bridge_calls_total{code="OK",method="Call",pool="b"}',
               'vllm_bridge_call_seconds_bucket{le="0.005",method="Call",pool="b"}',
               'vllm_bridge_queue_depth{pool="a"}', 'vllm_bridge_in_flight{pool="b"}',
               'vllm_bridge_worker_restarts_total{pool="a"} 0.0',
               'vllm_bridge_workers{pool="b",state="ready"} 2.0',
               'vllm_bridge_queue_wait_seconds_count{pool="a"}', 'vllm_bridge_stalled_streams{pool="b"} 0.0')
    deadline = time.monotonic() + 5     # a call is counted just after its reply has gone: maybe not yet
    while True:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode()
        missing = [n for n in needles if n not in body]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not missing, missing


def test_the_metrics_endpoint_serves_a_bounded_number_of_connections(server: PoolServer) -> None:
    """prometheus_client's own server gave every connection a thread and a file, idle ones for good
    (2,500 connections: 2,510 threads in the pool server). Past METRICS_PER_HOST connections from a
    host a connection is closed as it comes, and each is closed METRICS_CONNECTION_S after it came,
    however it trickles its request (16 sending a byte every 2 s had kept every scrape out)."""
    import socket

    import psutil

    from bridge_server.pool.metrics import METRICS_CONNECTION_S, METRICS_PER_HOST
    process = psutil.Process(server.proc.pid)
    before = process.num_threads()
    held = [socket.create_connection(("127.0.0.1", server.metrics_port), timeout=5) for _ in range(40)]
    try:
        time.sleep(0.5)
        # (a thread for each connection served, and one that ends it in time)
        assert process.num_threads() <= before + 2 * METRICS_PER_HOST + 2, process.num_threads() - before
        open_ones = []
        for s in held:
            s.settimeout(0.05)
            try:
                if s.recv(1) != b"":
                    open_ones.append(s)
            except (TimeoutError, socket.timeout):
                open_ones.append(s)
            except OSError:
                pass
        assert len(open_ones) <= METRICS_PER_HOST, len(open_ones)
        for _ in range(int(METRICS_CONNECTION_S) + 2):       # they trickle a request, a byte at a time
            for s in open_ones:
                try:
                    s.sendall(b"G")
                except OSError:
                    pass
            time.sleep(1)
        for s in open_ones:
            s.settimeout(2)
            try:
                assert s.recv(1) == b"", "a trickling connection outlived its time"
            except ConnectionResetError:
                pass
    finally:
        for s in held:
            s.close()

    def scraped() -> bool:
        try:
            return b"vllm_bridge_queue_depth" in urllib.request.urlopen(
                f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read()
        except OSError:
            return False
    wait_until(scraped, timeout=15, what="a scrape served")


def test_release_routes_refs_to_their_workers_and_sessions_to_every_worker(server: PoolServer) -> None:
    with server.client(pool="b") as c:
        refs = [c.call(PC, session_id=f"rel-{i}") for i in range(6)]
        assert len({holder(r) for r in refs}) == 2
        assert c.release(*refs[:3]) == 3
        with pytest.raises(CallError) as err:
            c.call(Target.get(refs[0], "world_size"))
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "released by the client" in err.value.details
        spread = [c.call(PC, session_id="rel-session", affinity="hint") for _ in range(2)]
        assert c.release(session_id="rel-session") == len(spread)
        assert c.call(Target.get(refs[4], "world_size")) == 1


def test_without_authentication_a_connection_releases_only_its_own_refs_of_a_session(server: PoolServer) -> None:
    """Without authentication every client's session of a name is one session (the default one is
    everybody's): releasing it by name ends only the refs the releasing connection made there, and
    the others' stay usable. (Over a unix socket, a worker's private one here, connections have no
    address to tell them apart by: there a session's release ends it all, as before.)"""
    from bridge_server.client.client import BridgeClient
    from bridge_server.wire.options import RuntimeOptions

    own = [("grpc.use_local_subchannel_pool", 1)]      # two connections, as two processes have

    def connect(address: str) -> BridgeClient:
        return BridgeClient(address, options=RuntimeOptions(pool="b"), channel_options=own)

    with connect(server.address) as alice, connect(server.address) as bob:
        hers = [alice.call(PC, session_id="everyones") for _ in range(3)]
        # what a Collective makes is its caller's too (the pool server named no client for it: every
        # client's Collective refs were one stranger's, which no release by name ended)
        hers += alice.collective(PC, session_id="everyones")
        his = [bob.call(PC, session_id="everyones") for _ in range(2)]
        assert bob.release(session_id="everyones") == 2
        assert all(alice.call(Target.get(ref, "world_size")) == 1 for ref in hers)
        for ref in his:
            with pytest.raises(CallError) as err:
                bob.call(Target.get(ref, "world_size"))
            assert err.value.code == grpc.StatusCode.NOT_FOUND and "released with its session" in err.value.details
        assert len(hers) > 3 and alice.release(session_id="everyones") == len(hers)


def test_multiplex_through_the_pool_routes_each_call_like_a_plain_call(server: PoolServer) -> None:
    with server.client(pool="b") as c, c.multiplex() as mux:
        plain = {s: holder(c.call(PC, session_id=s)) for s in ("mux-1", "mux-2", "mux-3", "mux-4")}
        assert len(set(plain.values())) == 2
        # Session pins hold whichever way a call comes in.
        assert {s: holder(mux.call(PC, session_id=s)) for s in plain} == plain
        ref = c.call(PC, session_id="mux-ref", kwargs={"data_parallel_size": 2})
        assert mux.call(Target.get(ref, "data_parallel_size")) == 2   # routed to the ref's worker
        assert mux.call(DIVIDE, 9, 3) == 3
        with pytest.raises(CallError) as err:
            mux.call(DIVIDE, 9, 3, pool="nope")
        assert err.value.category == "pool" and "nope" in err.value.details
        with ThreadPoolExecutor(16) as ex:
            assert list(ex.map(lambda i: mux.call(DIVIDE, 4 * i, 4), range(64))) == list(range(64))
    idle(server, "b")


def test_multiplex_through_the_pool_takes_requests_in_batches(server: PoolServer) -> None:
    multiplex_batches(server.address, (("x-bridge-pool", "b"),))


def test_a_large_request_through_the_pool_is_parsed_by_its_worker_in_its_turn(server: PoolServer) -> None:
    large_requests(server.address, (("x-bridge-pool", "b"),))
    idle(server, "b")


def test_multiplex_through_the_pool_keeps_a_calls_own_time_left(server: PoolServer) -> None:
    """A Multiplex call's `time_left_ms` is its deadline through the router too, not just the RPC's."""
    gate = Gate()
    with server.client(pool="b") as c:
        request, _ = c.request(gate.args()[0], gate.args()[1:])
    start = pb.MuxStart(id=7, call=request, time_left_ms=500, metadata={"x-bridge-pool": "b"})
    with grpc.insecure_channel(server.address) as ch:
        mux = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                               pb.MuxReply.FromString)
        t0 = time.monotonic()
        try:
            replies = list(mux(iter([pb.MuxRequest(start=start)]), timeout=20))
        finally:
            took = time.monotonic() - t0
            open_gates([gate])
    (event,) = [e for r in replies for e in r.events]
    assert event.id == 7 and event.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], event
    assert took < 5, took
    idle(server, "b")


def test_multiplex_through_the_pool_refuses_a_start_with_a_running_calls_id_under_id_0(server: PoolServer) -> None:
    """Under its own id the refusal would end the running call for the client; under id 0 it does not."""
    import queue
    gate = Gate()
    with server.client(pool="b") as c:
        request, _ = c.request(gate.args()[0], gate.args()[1:])
        other, _ = c.request(DIVIDE, (9, 3))
    outgoing: queue.Queue[object] = queue.Queue()
    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=3, call=request, metadata={"x-bridge-pool": "b"})))
    outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=3, call=other, metadata={"x-bridge-pool": "b"})))
    events: list[pb.MuxEvent] = []
    opened = False
    with grpc.insecure_channel(server.address) as ch:
        mux = ch.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                               pb.MuxReply.FromString)
        try:
            for reply in mux(iter(outgoing.get, None), timeout=60):
                events.extend(reply.events)
                if not opened and any(e.id == 0 for e in events):    # refused: now let call 3 finish
                    wait_until(gate.running, what="the gated call running in a worker")
                    open_gates([gate])
                    opened = True
                if any(e.id == 3 for e in events):
                    outgoing.put(None)
        finally:
            if not opened:
                open_gates([gate])
    (refused,) = [e for e in events if e.id == 0]
    assert "call id 3 is still running" in refused.error.message
    (result,) = [e for e in events if e.id == 3]
    assert result.WhichOneof("kind") == "value", result
    idle(server, "b")


def test_multiplex_through_the_pool_a_call_cancelled_while_queued_before_it_began_is_answered(
        server: PoolServer) -> None:
    """A start and its cancel in one batch, while the pool is full: the call's queued task is cancelled
    before it ever runs, so its own refusal and its leaving the queue never happened, and the stream
    waited for it for ever. Whoever cancels it answers it now."""
    idle(server, "a")
    gates = [Gate(), Gate()]
    with server.client(pool="a") as c:
        busy = [in_thread(lambda g=g: c.call(*g.args(), timeout=60)) for g in gates]
        try:
            wait_until(lambda: server.pool("a").in_flight == 2, what="both workers of pool a busy")
            call, _ = c.request(DIVIDE, (9, 3))
            batch = pb.MuxRequest(batch=pb.MuxBatch(requests=[
                pb.MuxRequest(start=pb.MuxStart(id=5, call=call, metadata={"x-bridge-pool": "a"})),
                pb.MuxRequest(cancel=5)]))
            with grpc.insecure_channel(server.address) as ch:
                replies = list(pb_grpc.BridgeStub(ch).Multiplex(iter([batch]), timeout=30))   # half-closes at once
        finally:
            open_gates(gates)
        for out in busy:
            assert out.done.wait(30) and out.error is None, out.error
    (event,) = [e for r in replies for e in r.events]
    assert event.id == 5 and event.error.code == grpc.StatusCode.CANCELLED.value[0], event
    idle(server, "a")


def test_multiplex_through_the_pool_a_worker_crash_fails_only_its_calls(server: PoolServer) -> None:
    import os
    import signal

    import psutil
    gate = Gate()
    with server.client(pool="b") as c, c.multiplex() as mux:
        held = in_thread(lambda: mux.call(*gate.args(), session_id="mux-crash"))
        wait_until(gate.running, what="the gated call running in a worker")
        victim = next(conn.pid for conn in psutil.net_connections(kind="tcp")
                      if conn.laddr and conn.laddr.port == gate.port and conn.status == psutil.CONN_LISTEN)
        os.kill(victim, signal.SIGKILL)
        assert held.done.wait(30) and held.error is not None
        assert held.error.code == grpc.StatusCode.UNAVAILABLE and "worker crashed" in held.error.details
        assert mux.call(DIVIDE, 8, 2) == 4    # the stream and the other worker go on
    wait_until(lambda: sum(w.state == "ready" for w in server.pool("b").workers) == 2, timeout=120,
               what="pool b back to two workers")
    idle(server, "b")


def test_refs_in_a_large_requests_bytes_are_found_by_their_whole_id_past_near_misses() -> None:
    """The search of a large request's bytes takes an id only where its length byte covers exactly
    the worker's id, a dot and a token that ends there; runs of token characters too long to be one
    are passed over in the regular expression, not walked in Python (8 MiB after a worker's id and a
    dot held the pool server's loop 0.5 s)."""
    from bridge_server.pool.router import Router
    router = Router([], "a")
    router.backends = dict.fromkeys(("a-0-g1", "a-1-g1"))     # type: ignore[arg-type]  # (only their ids count)
    real = pb.Ref(id="a-1-g1.tok_EN-42").SerializeToString()
    assert real.startswith(b"\x0a\x10")
    near = [b"\x0a\x10a-0-g1." + b"A" * 200,                  # a token longer than any id allows
            b"\x0a\x07a-0-g1.\x12",                            # no token
            pb.Ref(id="a-0-g1x.tok").SerializeToString()]       # no such worker
    assert router.named_in([b"".join(near * 1000) + real]) == ["a-1-g1.tok_EN-42"]
    wrong_length = b"\x0a\x08a-0-g1.abc"                       # a length that says less than is there
    assert router.named_in([wrong_length * 10 + real]) == ["a-1-g1.tok_EN-42"]
    assert router.named_in([b"\x0a\x10a-0-g1." + b"A" * (8 << 20)]) == []
    assert router.named_in([real + pb.Ref(id="a-0-g1.x").SerializeToString()]) == ["a-1-g1.tok_EN-42", "a-0-g1.x"]


def test_the_refs_a_request_carries_are_looked_for_within_the_budget_only() -> None:
    """The router looks for refs among a request's first PAYLOAD_REF_SCAN values. It took every item
    of a container out before counting: a list of 30 million empty values (57 MiB) cost the pool
    server 7 GB and most of a minute."""
    import tracemalloc

    from bridge_server.pool.router import PAYLOAD_REF_SCAN, payload_refs

    near, far = pb.Value(ref=pb.Ref(id="near")), pb.Value(ref=pb.Ref(id="far"))
    request = pb.CallRequest(target=pb.Target(kind=pb.Target.METHOD, name="m", ref=pb.Ref(id="receiver")))
    request.args.add().list.items.extend([near] + [pb.Value()] * 1_000_000 + [far])
    request.args.add().map.entries.add(key=pb.Value(str="k"), value=pb.Value(ref=pb.Ref(id="in a map")))
    tracemalloc.start()
    try:
        found = payload_refs(request)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == ["receiver", "in a map", "near"]
    assert peak < 200 * PAYLOAD_REF_SCAN, f"{peak:,} bytes allocated to look at {PAYLOAD_REF_SCAN} values"


def test_a_large_request_is_read_by_the_router_for_its_target_and_first_arguments_only() -> None:
    """A request of LARGE_REQUEST_BYTES or more is read as a view: its target, and its arguments up
    to that many bytes, scanned for the refs they carry. A larger argument stays bytes, however it is
    made (here: not a Value at all), for its worker to parse in the caller's turn; a small request is
    still parsed whole, and refused where it is read."""
    from bridge_server.pool.router import payload_refs, routed_request
    from bridge_server.wire.errors import BridgeError
    from bridge_server.wire.protocol import LARGE_REQUEST_BYTES

    receiver = pb.Target(kind=pb.Target.METHOD, name="m", ref=pb.Ref(id="receiver"))
    near = pb.Value(ref=pb.Ref(id="near")).SerializeToString()
    kw = pb.Value(ref=pb.Ref(id="kw")).SerializeToString()
    broken = b"\x42\x05\x01"                   # a list whose length runs past its end
    big = broken + b"\x00" * LARGE_REQUEST_BYTES
    view = pb.CallRequestView(target=receiver, args=[near, big], kwargs={"k": kw})
    head = routed_request(view.SerializeToString(), "Call")
    assert payload_refs(head) == ["receiver", "kw", "near"]
    assert len(head.args) == 1 and head.target == receiver
    small = pb.CallRequestView(target=receiver, args=[near, broken]).SerializeToString()
    with pytest.raises(BridgeError) as err:
        routed_request(small, "Call")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid" in err.value.message


def test_what_a_router_writes_as_bytes_arrives_with_its_presence() -> None:
    """The router passes a worker's values and patches on as bytes, in views of the messages clients
    read. An empty patch (nothing changed since the item before) is zero bytes: in a plain `bytes`
    field it was not sent at all, so a `Stream` client got an item with neither a value nor a patch
    (the Elixir client then took an empty Value for the state, and failed on the next patch)."""
    from vllm_bridge.v1 import bridge_pb2 as pb

    empty_patch = pb.StreamPatch().SerializeToString()
    assert empty_patch == b""
    item = pb.StreamItem.FromString(pb.StreamItemView(index=3, patch=empty_patch).SerializeToString())
    assert item.index == 3 and item.HasField("patch") and not item.HasField("value")
    item = pb.StreamItem.FromString(pb.StreamItemView(index=4, value=b"").SerializeToString())
    assert item.HasField("value") and not item.HasField("patch")
    assert pb.CallReply.FromString(pb.CallReplyView(value=b"").SerializeToString()).HasField("value")
    for kind in ("value", "patch"):    # a lane's events, and a Multiplex client's
        event = pb.MuxEvent.FromString(pb.MuxEventView(id=1, **{kind: b""}).SerializeToString())
        assert event.WhichOneof("kind") == kind
