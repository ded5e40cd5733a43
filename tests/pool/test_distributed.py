"""End to end: pools whose workers are the ranks of one gloo group, collectives across real worker
processes, and a group that survives losing a rank."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from bridge_server.client.client import BridgeClient, CallError, Target
from tests.conftest import free_port
from tests.pool.harness import GATE_TARGET, PoolServer, start_pool_server, wait_until
from vllm_bridge.v1 import bridge_pb2 as pb

D = "vllm.distributed"
CONFIG = """
[[pools]]
name = "tp"
workers = 2
restart_backoff_s = 0.2
[pools.distributed]
backend = "gloo"
tensor_parallel_size = 2

[[pools]]
name = "pp"
workers = 2
[pools.distributed]
backend = "gloo"
tensor_parallel_size = 1
pipeline_parallel_size = 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    s = start_pool_server(tmp_path_factory.mktemp("dist"), CONFIG)
    yield s
    s.stop()


@pytest.fixture()
def tp(server: PoolServer) -> Iterator[BridgeClient]:
    with server.client(pool="tp") as c:
        yield c


def per_rank(*tensors: torch.Tensor) -> list[tuple[tuple[object, ...], dict[str, object]]]:
    return [((t,), {}) for t in tensors]


def test_all_reduce_sums_the_ranks_tensors_on_every_rank(tp: BridgeClient) -> None:
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(4), torch.ones(4) * 2))
    assert [t.tolist() for t in out] == [[3.0] * 4, [3.0] * 4]


def test_a_client_cannot_swap_the_pools_tensor_parallel_group(tp: BridgeClient) -> None:
    """`patch_tensor_parallel_group`, entered on every rank, put a stranger's groups in force for
    every client: others' all_reduce came back unreduced, silently. The pool's groups are the
    server's, so only an operator swaps them."""
    groups = tp.collective(f"{D}.get_tp_group")
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.patch_tensor_parallel_group", per_rank=[((g,), {}) for g in groups])
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "the server's" in err.value.details and "swaps them" in err.value.details, err.value.details
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)))
    assert [t.tolist() for t in out] == [[2.0, 2.0]] * 2


def test_all_gather_gather_and_reduce_scatter_move_real_tensors(tp: BridgeClient) -> None:
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    gathered = tp.collective(f"{D}.tensor_model_parallel_all_gather", per_rank=per_rank(a, b))
    assert [t.tolist() for t in gathered] == [[1.0, 2.0, 3.0, 4.0]] * 2
    at_root = tp.collective(f"{D}.tensor_model_parallel_gather", per_rank=per_rank(a, b))
    assert at_root[0].tolist() == [1.0, 2.0, 3.0, 4.0] and at_root[1] is None
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])
    scattered = tp.collective(f"{D}.tensor_model_parallel_reduce_scatter", per_rank=per_rank(x, x * 2))
    assert [t.tolist() for t in scattered] == [[3.0, 6.0], [9.0, 12.0]]


def test_broadcast_tensor_dict_reaches_every_rank(tp: BridgeClient) -> None:
    sent = {"weights": torch.arange(6, dtype=torch.float32).reshape(2, 3), "step": 7}
    out = tp.collective(f"{D}.broadcast_tensor_dict", per_rank=[((sent,), {}), ((None,), {})])
    for got in out:
        assert got["step"] == 7 and torch.equal(got["weights"], sent["weights"])


def test_ranks_and_groups_report_the_pools_layout(server: PoolServer, tp: BridgeClient) -> None:
    assert tp.collective(f"{D}.get_tensor_model_parallel_rank") == [0, 1]
    assert tp.collective(f"{D}.get_tensor_model_parallel_world_size") == [2, 2]
    assert tp.call(f"{D}.get_tensor_model_parallel_rank", rank=1) == 1     # one rank, by name
    pp_groups = tp.collective(f"{D}.get_pp_group")
    assert [tp.call(Target.get(g, "world_size")) for g in pp_groups] == [1, 1]
    with server.client(pool="pp") as pp:
        assert pp.collective(f"{D}.get_tensor_model_parallel_world_size") == [1, 1]
        groups = pp.collective(f"{D}.get_pp_group")
        assert [pp.call(Target.get(g, "world_size")) for g in groups] == [2, 2]
        assert [pp.call(Target.get(g, "rank_in_group")) for g in groups] == [0, 1]
        assert pp.collective(f"{D}.get_pp_indices", 32, 0, 2) == [(0, 16), (0, 16)]


def test_concurrent_clients_collectives_do_not_interleave(server: PoolServer) -> None:
    errors: list[BaseException] = []

    def client(seed: float) -> None:
        try:
            with server.client(pool="tp") as c:
                for i in range(10):
                    out = c.collective(f"{D}.tensor_model_parallel_all_reduce",
                                       per_rank=per_rank(torch.full((3,), seed + i), torch.full((3,), seed)), timeout=30)
                    assert [t.tolist() for t in out] == [[2 * seed + i] * 3] * 2
                    gathered = c.collective(f"{D}.tensor_model_parallel_all_gather",
                                            per_rank=per_rank(torch.tensor([seed]), torch.tensor([seed + 1])), timeout=30)
                    assert [t.tolist() for t in gathered] == [[seed, seed + 1]] * 2
        except BaseException as exc:   # reported below, with the thread's assertion intact
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(s,)) for s in (1.0, 100.0)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors


def test_a_call_that_fails_on_every_rank_reports_rank_0_and_keeps_the_group(server: PoolServer,
                                                                           tp: BridgeClient) -> None:
    restarts = server.pool("tp").restarts
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.ensure_divisibility", 7, 2)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "rank 0" in err.value.details and "7 is not divisible by 2" in err.value.details
    assert err.value.detail.python_type == "AssertionError"
    assert server.pool("tp").restarts == restarts
    assert tp.collective(f"{D}.divide", 6, 3) == [2, 2]


@pytest.mark.parametrize("shares, parameter, said", [
    ((torch.ones(2), torch.ones(2, dtype=torch.float64)), "per_rank[1]", "input_: float64 [2] against input_: float32 [2]"),
    ((torch.ones(2), torch.ones(3)), "per_rank[1]", "input_: float32 [3] against input_: float32 [2]"),
    (("x", torch.ones(2)), "per_rank[0].input_", "expected torch.Tensor, got str"),
    ((torch.ones(2), [1, 2]), "per_rank[1].input_", "expected torch.Tensor, got list"),
], ids=["dtypes", "sizes", "rank 0 refused", "rank 1 refused"])
def test_ranks_whose_shares_disagree_or_are_refused_are_refused_before_any_runs(
        server: PoolServer, tp: BridgeClient, shares: tuple[object, object], parameter: str, said: str) -> None:
    """An all_reduce of a float32 tensor on rank 0 and a float64 one on rank 1 aborted the process
    group (gloo killed rank 0 with SIGABRT); tensors of two sizes left a rank waiting for ever; a
    share one rank refused left the other inside the collective. Each time the group restarted,
    NOT_SERVING, and every client's refs on it were lost. Every rank's share is checked first."""
    pool = server.pool("tp")
    restarts, pids = pool.restarts, {w.pid for w in pool.workers}
    group = tp.collective(f"{D}.get_tp_group")          # a ref on each rank, which must outlive this
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=[((x,), {}) for x in shares], timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert err.value.detail.parameter == parameter and said in err.value.details, err.value.details
    assert server.pool("tp").restarts == restarts and {w.pid for w in server.pool("tp").workers} == pids
    assert [tp.call(Target.get(g, "world_size")) for g in group] == [2, 2]
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)),
                        timeout=30)
    assert [x.tolist() for x in out] == [[2.0, 2.0]] * 2


def test_a_ref_made_on_another_rank_is_refused_by_name_and_the_group_serves_on(server: PoolServer,
                                                                              tp: BridgeClient) -> None:
    """Each rank's call runs on its own rank: a ref of rank 1 given to rank 0 is unknown there. The
    refusal says so, rather than the hint a Call gets (list it in x-bridge-refs), which cannot apply."""
    groups = tp.collective(f"{D}.get_tp_group")

    def on(receivers: list[pb.Ref]) -> list[int]:
        calls = [tp.request(Target.get(g, "rank_in_group"), (), {})[0] for g in receivers]
        reply = tp.stub.Collective(pb.CollectiveRequest(per_rank=calls), timeout=30,
                                   metadata=tp._metadata([g.id for g in receivers], {}))
        return [tp._decoder.decode(r.value) for r in reply.results]

    restarts = server.pool("tp").restarts
    assert on(groups) == [0, 1]
    with pytest.raises(grpc.RpcError) as err:
        on(groups[::-1])
    failed = CallError(err.value)
    assert failed.code == grpc.StatusCode.NOT_FOUND, failed
    assert failed.detail.parameter.startswith("per_rank[0]"), failed.detail
    assert f"ref {groups[1].id} is not this rank's" in failed.details, failed.details
    assert "x-bridge-refs" not in failed.details, failed.details
    assert on(groups) == [0, 1] and server.pool("tp").restarts == restarts
    # a Call runs where its refs are: one that names another rank is refused, not run there
    assert tp.call(Target.get(groups[1], "rank_in_group"), rank=1) == 1
    with pytest.raises(CallError) as err:
        tp.call(Target.get(groups[1], "rank_in_group"), rank=0)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "x-bridge-rank"
    assert "is held by rank 1" in err.value.details, err.value.details


def test_ranks_that_name_two_roots_are_refused_before_any_runs(server: PoolServer, tp: BridgeClient) -> None:
    restarts = server.pool("tp").restarts
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.tensor_model_parallel_gather",
                      per_rank=[((torch.ones(2),), {"dst": 0}), ((torch.ones(2),), {"dst": 1})], timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.detail.parameter == "per_rank[1]"
    assert "dst: 1" in err.value.details and "dst: 0" in err.value.details, err.value.details
    assert server.pool("tp").restarts == restarts


def test_killing_a_rank_mid_collective_fails_it_fast_and_the_group_comes_back(server: PoolServer,
                                                                             tp: BridgeClient) -> None:
    rank1 = next(w for w in server.pool("tp").workers if w.index == 1)
    # Both ranks are held in a blocking call (each waits for a peer of its own that never comes).
    calls = [(("127.0.0.1", free_port(), 0, 2, "gloo"), {}), (("127.0.0.1", free_port(), 0, 2, "gloo"), {})]
    result: dict[str, BaseException] = {}

    def run() -> None:
        try:
            with server.client(pool="tp") as c:
                c.collective(GATE_TARGET, per_rank=calls, timeout=60)
        except CallError as exc:
            result["error"] = exc

    t = threading.Thread(target=run)
    t.start()
    time.sleep(1.5)
    killed_at = time.monotonic()
    os.kill(rank1.pid, signal.SIGKILL)
    t.join(30)
    failed_after = time.monotonic() - killed_at
    err = result["error"]
    assert isinstance(err, CallError) and err.code == grpc.StatusCode.UNAVAILABLE
    assert "rank 1" in err.details and "restarting" in err.details
    assert failed_after < 5
    wait_until(lambda: server.pool("tp").state == "serving" and server.pool("tp").restarts >= 2, 90, "the group back")
    assert {w.pid for w in server.pool("tp").workers}.isdisjoint({rank1.pid})
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)),
                        timeout=30)
    assert [x.tolist() for x in out] == [[2.0, 2.0]] * 2


def test_a_collective_called_on_one_rank_is_refused_and_the_group_serves_on(server: PoolServer,
                                                                             tp: BridgeClient) -> None:
    """A plain Call of an entry that talks to every rank would wait in gloo for a peer that never
    joins, and every later collective of the pool behind it: refused before it starts, on any rank."""
    restarts = server.pool("tp").restarts
    for rank in (0, 1):
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            tp.call(f"{D}.tensor_model_parallel_all_reduce", torch.ones(2), rank=rank, timeout=10)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and "Collective" in err.value.details
        assert err.value.reason == "use Collective" and time.monotonic() - t0 < 2
    with pytest.raises(grpc.RpcError):   # nor can a client claim to be a collective's share
        tp.stub.Call(tp.request(f"{D}.tensor_model_parallel_all_reduce", (torch.ones(2),))[0], timeout=10,
                     metadata=(("x-bridge-pool", "tp"), ("x-bridge-collective", "1")))
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)),
                        timeout=30)
    assert [x.tolist() for x in out] == [[2.0, 2.0]] * 2
    assert tp.call(f"{D}.divide", 6, 3) == 2      # what talks to no other rank still runs anywhere
    assert server.pool("tp").restarts == restarts and server.pool("tp").state == "serving"


def test_a_collective_stuck_past_its_deadline_restarts_the_group(server: PoolServer, tp: BridgeClient) -> None:
    """Ranks stuck inside a collective (here both wait for peers of their own that never come)
    cannot be pre-empted: at the deadline the caller is told, and the group starts again, NOT_SERVING
    meanwhile, instead of every later collective timing out behind them."""
    restarts = server.pool("tp").restarts
    calls = [(("127.0.0.1", free_port(), 0, 2, "gloo"), {}), (("127.0.0.1", free_port(), 0, 2, "gloo"), {})]
    with pytest.raises(CallError) as err:
        tp.collective(GATE_TARGET, per_rank=calls, timeout=2)
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and "still running" in err.value.details
    wait_until(lambda: server.pool("tp").state in ("regrouping", "starting"), 10, "the group restarting")
    wait_until(lambda: server.pool("tp").state == "serving" and server.pool("tp").restarts >= restarts + 2, 90,
               "the group back")
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)),
                        timeout=30)
    assert [x.tolist() for x in out] == [[2.0, 2.0]] * 2


def test_ranks_left_inside_a_collective_after_the_others_ended_restart_the_group_without_a_deadline(
        server: PoolServer, tp: BridgeClient) -> None:
    """Rank 0 makes a process group of one rank (done at once), rank 1 one of two (its peer never
    comes), with no deadline (`batch_job`): rank 1 held the pool's collective lock for as long as its
    caller stayed connected, every other client's collectives timing out behind it, health SERVING.
    Ranks still inside SKEW_S after others ended are stuck: the caller is told, and the group restarts."""
    from bridge_server.pool.collective import SKEW_S
    restarts = server.pool("tp").restarts
    calls = [(("127.0.0.1", free_port(), 0, 1, "gloo"), {}), (("127.0.0.1", free_port(), 0, 2, "gloo"), {})]
    t0 = time.monotonic()
    with pytest.raises(CallError) as err:
        tp.collective(GATE_TARGET, per_rank=calls, timeout_profile="batch_job")
    took = time.monotonic() - t0
    assert err.value.code == grpc.StatusCode.ABORTED and err.value.reason == "ranks stuck", err.value
    assert f"still in it {SKEW_S:g} s after rank(s) 0 had ended" in err.value.details, err.value.details
    assert SKEW_S <= took < SKEW_S + 10, took
    wait_until(lambda: server.pool("tp").state == "serving" and server.pool("tp").restarts >= restarts + 2, 90,
               "the group back")
    out = tp.collective(f"{D}.tensor_model_parallel_all_reduce", per_rank=per_rank(torch.ones(2), torch.ones(2)),
                        timeout=30)
    assert [x.tolist() for x in out] == [[2.0, 2.0]] * 2


def test_a_collective_answered_late_only_because_its_deadline_was_short_keeps_the_group(
        server: PoolServer, tp: BridgeClient) -> None:
    """Ranks still running at the caller's deadline are not stuck unless they stay so: a restart then
    let a 30-byte `divide` with a 0.2 s deadline take the pool down for 7-13 s, as often as sent.
    Each rank ends (or answers its own deadline) within the grace, and the group goes on."""
    restarts = server.pool("tp").restarts
    for _ in range(3):
        try:
            tp.collective(f"{D}.divide", 6, 3, timeout=0.2)
        except CallError as err:
            assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED, err
    time.sleep(3)       # past the grace
    assert server.pool("tp").restarts == restarts and server.pool("tp").state == "serving"
    assert tp.collective(f"{D}.divide", 6, 3, timeout=10) == [2, 2]


def test_collective_argument_errors(tp: BridgeClient, server: PoolServer, tmp_path: Path) -> None:
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.divide", per_rank=[((6, 3), {})])
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "2 ranks" in err.value.details
    # Ranks that would run different collectives wait for each other forever: refused before either starts.
    restarts = server.pool("tp").restarts
    reqs = [tp.request(f"{D}.tensor_model_parallel_all_reduce", (torch.ones(2),))[0],
            tp.request(f"{D}.tensor_model_parallel_all_gather", (torch.ones(2),))[0]]
    with pytest.raises(grpc.RpcError) as rpc_err:
        tp.stub.Collective(pb.CollectiveRequest(per_rank=reqs), timeout=30)
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT   # type: ignore[attr-defined]
    assert "every rank must run the same target" in rpc_err.value.details()   # type: ignore[attr-defined]
    # both forms at once: which to run would be a guess (the pool took per_rank, a worker alone `call`)
    divide = [tp.request(f"{D}.divide", (6, 3))[0]] * 2
    with pytest.raises(grpc.RpcError) as rpc_err:
        tp.stub.Collective(pb.CollectiveRequest(call=divide[0], per_rank=divide), timeout=30)
    assert rpc_err.value.code() == grpc.StatusCode.INVALID_ARGUMENT   # type: ignore[attr-defined]
    assert "not both" in rpc_err.value.details()   # type: ignore[attr-defined]
    assert tp.collective(f"{D}.divide", 6, 3) == [2, 2] and server.pool("tp").restarts == restarts


# Documented vllm.distributed functions, called as collectives on every rank with plausible arguments.
# Each must reach vLLM and either return or raise vLLM's own error: never a bridge failure.
SWEEP: list[tuple[str, tuple[object, ...]]] = [
    ("get_tp_group", ()), ("get_pp_group", ()), ("get_dp_group", ()), ("get_ep_group", ()), ("get_dcp_group", ()),
    ("get_pcp_group", ()), ("get_world_group", ()), ("get_context_model_parallel_group", ()),
    ("get_inner_dp_world_group", ()), ("get_tensor_model_parallel_rank", ()),
    ("get_tensor_model_parallel_world_size", ()), ("get_decode_context_model_parallel_rank", ()),
    ("get_decode_context_model_parallel_world_size", ()), ("get_node_count", ()), ("is_global_first_rank", ()),
    ("is_local_first_rank", ()), ("model_parallel_is_initialized", ()),
    ("get_distributed_init_method", ("127.0.0.1", 1234)), ("get_tcp_uri", ("127.0.0.1", 1234)),
    ("get_pp_indices", (32, 0, 2)), ("divide", (6, 3)), ("ensure_divisibility", (6, 3)),
    ("is_torch_equal_or_newer", ("2.0",)), ("split_tensor_along_last_dim", (torch.ones(2, 4), 2)),
    ("sched_yield", ()), ("resolve_obj_by_qualname", ("vllm.distributed.divide",)),
    ("init_logger", ("bridge.test",)), ("logger", ()), ("use_sched_yield", ()),
    ("all_reduce", (torch.ones(3), "tp:0")), ("all_gather", (torch.ones(3), 0, 2, "tp:0")),
    ("reduce_scatter", (torch.ones(4), 0, 2, "tp:0")), ("all_reduce_fake", (torch.ones(3), "tp:0")),
    ("all_gather_fake", (torch.ones(3), 0, 2, "tp:0")), ("reduce_scatter_fake", (torch.ones(4), 0, 2, "tp:0")),
    ("tensor_model_parallel_all_reduce", (torch.ones(2),)),
]


def test_documented_distributed_functions_reach_vllm_on_a_group(tp: BridgeClient) -> None:
    problems = []
    for name, args in SWEEP:
        try:
            results = tp.collective(f"{D}.{name}", *args, timeout=30)
            assert len(results) == 2
        except CallError as err:
            if err.category != "python_error":      # vLLM's own error is an answer; ours is not
                problems.append(f"{name}: {err.code.name} {err.category}: {err.details}")
    assert not problems, "\n".join(problems)
    assert tp.collective(f"{D}.all_reduce", torch.ones(3), "tp:0")[0].tolist() == [2.0, 2.0, 2.0]
    # how the next groups are made is a change of the groups: the pool's own are the server's
    with pytest.raises(CallError) as err:
        tp.collective(f"{D}.set_custom_all_reduce", True)
    assert err.value.code == grpc.StatusCode.PERMISSION_DENIED, err.value
    assert "process groups are the server's" in err.value.details, err.value
    # graph capture needs a CUDA device (vLLM said so only once its manager was entered, and without
    # CUDA torch's own error was UNKNOWN): refused by the parameter, for what the worker lacks
    for device, code in (("cpu", grpc.StatusCode.INVALID_ARGUMENT), ("cuda", grpc.StatusCode.FAILED_PRECONDITION)):
        with pytest.raises(CallError) as err:
            tp.collective(f"{D}.graph_capture", device)
        assert err.value.code == code and err.value.detail is not None, err.value
        assert err.value.detail.parameter == "device" and "CUDA" in err.value.details, err.value
