"""The supervisor end to end: a worker killed with calls in flight, a pool that keeps crashing,
recycling with draining, and SIGTERM of the server with calls in flight. Real processes only."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.client.client import CallError, Target
from bridge_server.pool.workerproc import kill_group
from bridge_server.wire.eventloop import LOOPS
from tests.pool.harness import Gate, PoolServer, group_members, in_thread, open_gates, start_pool_server, wait_until

PC = "vllm.config.ParallelConfig"
DIVIDE = "vllm.distributed.divide"

CONFIG = """
grace_s = 10
[[pools]]
name = "c"
workers = 1
max_concurrent = 32
restart_backoff_s = 0.2

[[pools]]
name = "r"
workers = 1
max_concurrent = 8
recycle_after_calls = 40

[[pools]]
name = "rt"
workers = 1
max_concurrent = 4
recycle_after_calls = 3
drain_timeout_s = 1

[[pools]]
name = "h"
workers = 1
probe_interval_s = 0.5
probe_timeout_s = 1

[[pools]]
name = "broken"
workers = 1
worker_args = ["--no-such-option"]
restart_backoff_s = 0.05
max_restarts = 2
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    s = start_pool_server(tmp_path_factory.mktemp("pool-lifecycle"), CONFIG)
    yield s
    s.stop()


def test_kill_9_fails_the_in_flight_calls_at_once_and_the_worker_is_replaced(server: PoolServer) -> None:
    with server.client(pool="c") as c:
        ref = c.call(PC, session_id="crash-keep")
        c.call(PC, session_id="crash-strict")
        before = server.pool("c").workers[0]
        assert before.id == "c-0-g1" and before.state == "ready"
        assert [p.pid for p in group_members(before.pid)] == [before.pid]
        # (12: what one client may hold of the worker's 16 threads alone, `worker/threadshares.py`)
        gates = [Gate() for _ in range(12)]
        calls = [in_thread(lambda g=g, i=i: c.call(*g.args(), session_id=f"crash-{i}")) for i, g in enumerate(gates)]
        wait_until(lambda: server.pool("c").in_flight == 12, what="12 calls in flight")
        wait_until(lambda: all(g.running() for g in gates), what="all 12 running in the worker")

        killed = time.monotonic()
        os.kill(before.pid, signal.SIGKILL)
        for out in calls:
            assert out.done.wait(10)
        assert max(out.ended for out in calls) - killed < 1.0
        for out in calls:
            assert out.error is not None, out.value
            assert out.error.code == grpc.StatusCode.UNAVAILABLE and out.error.reason == "worker crashed"
            assert out.error.category == "worker" and "c-0-g1" in out.error.details
            assert "SIGKILL" in out.error.details

        # Nothing of the killed worker's process group is left.
        wait_until(lambda: not group_members(before.pid), timeout=5, what="the killed worker's group gone")

        # It is replaced, and new calls succeed.
        wait_until(lambda: (w := server.pool("c").workers[0]).state == "ready" and w.generation == 2,
                   timeout=120, what="the replacement ready")
        pool = server.pool("c")
        assert pool.restarts == 1 and pool.workers[0].id == "c-0-g2" and "SIGKILL" in pool.workers[0].last_exit
        assert c.call(DIVIDE, 9, 3) == 3

        # Its refs and its strict sessions are lost, with an error that names them; hint moves on.
        with pytest.raises(CallError) as err:
            c.call(Target.get(ref, "world_size"))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "worker lost"
        assert ref.id in err.value.details and "c-0-g1" in err.value.details
        with pytest.raises(CallError) as err:
            c.call(PC, session_id="crash-strict", affinity="strict_queue")
        assert err.value.reason == "worker lost" and "'crash-strict'" in err.value.details
        assert c.call(PC, session_id="crash-strict", affinity="hint").worker_id == "c-0-g2"
        assert c.call(PC, session_id="crash-strict", affinity="strict_fail_fast").worker_id == "c-0-g2"


def test_a_worker_that_answers_nothing_is_found_and_replaced(server: PoolServer) -> None:
    """A worker whose event loop is blocked (here: the whole process stopped) pushes no health
    change: the supervisor's own checks find it, stop routing to it, then replace it."""
    before = server.pool("h").workers[0]
    with server.client(pool="h") as c:
        assert c.call(DIVIDE, 6, 3, timeout=10) == 2
        os.kill(before.pid, signal.SIGSTOP)
        try:
            wait_until(lambda: server.pool("h").workers[0].state == "unhealthy", 15, "the worker found unhealthy")
            assert "answered no health check" in server.pool("h").workers[0].detail
            with pytest.raises(CallError) as err:          # at once, saying why: not at the deadline
                c.call(DIVIDE, 6, 3, timeout=10)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "answered no health check" in err.value.details
            wait_until(lambda: server.pool("h").workers[0].pid not in (0, before.pid)
                       and server.pool("h").workers[0].state == "ready", 60, "the worker replaced")
        finally:
            try:
                os.kill(before.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        assert c.call(DIVIDE, 6, 3, timeout=10) == 2
    after = server.pool("h").workers[0]
    assert after.restarts == 1 and "answered no health check" in after.last_exit, after


def test_a_pool_that_keeps_crashing_is_degraded_instead_of_restarting_forever(server: PoolServer) -> None:
    pool = server.pool("broken")
    assert pool.state == "degraded" and "worker crashes within" in pool.detail, pool
    assert pool.workers[0].state == "failed" and "exited with code 2" in pool.workers[0].last_exit
    restarts = pool.restarts
    time.sleep(1.0)
    assert server.pool("broken").restarts == restarts == 2
    assert server.status().state == "degraded"
    with grpc.insecure_channel(server.address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        status = {s: health.Check(health_pb2.HealthCheckRequest(service=s), timeout=5).status
                  for s in ("", "pool/c", "pool/broken")}
    assert status == {"": health_pb2.HealthCheckResponse.NOT_SERVING, "pool/c": health_pb2.HealthCheckResponse.SERVING,
                      "pool/broken": health_pb2.HealthCheckResponse.NOT_SERVING}
    with server.client(pool="broken") as c:
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            c.call(DIVIDE, 4, 2)
        assert time.monotonic() - t0 < 1
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and "degraded" in err.value.details


CONFIG_HEAL = """
[[pools]]
name = "heal"
workers = 1
restart_backoff_s = 0.05
max_restarts = 1
degraded_retry_s = 1
log_dir = "{logs}"
"""


def test_a_degraded_pool_tries_again_and_serves_once_its_workers_start(tmp_path: Path) -> None:
    # Its worker cannot start while a file stands where its log folder should be.
    logs = tmp_path / "logs"
    logs.touch()
    server = start_pool_server(tmp_path, CONFIG_HEAL.replace("{logs}", str(logs)))
    try:
        pool = server.pool("heal")
        assert pool.state == "degraded" and "could not start" in pool.workers[0].last_exit, pool
        wait_until(lambda: server.pool("heal").restarts >= 3, timeout=120, what="two more tries, a second apart")
        assert server.pool("heal").state == "degraded"
        with server.client(pool="heal") as c:
            with pytest.raises(CallError) as err:
                c.call(DIVIDE, 4, 2)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "degraded" in err.value.details
            logs.unlink()
            wait_until(lambda: server.pool("heal").state == "serving", timeout=120, what="the pool serving again")
            assert c.call(DIVIDE, 4, 2) == 2
        assert "pool heal recovered" in server.log_text()
        assert (logs / f"{server.pool('heal').workers[0].id}.log").is_file()
        with grpc.insecure_channel(server.address) as ch:
            check = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pool/heal"), timeout=5)
        assert check.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        server.stop()


def test_a_worker_is_recycled_after_its_calls_and_drained_first(server: PoolServer) -> None:
    first = server.pool("r").workers[0]
    assert first.id == "r-0-g1"
    gate = Gate()
    with server.client(pool="r", session_id="recycle") as c:
        ref = c.call(PC)
        slow = in_thread(lambda: c.call(*gate.args(), affinity="strict_queue"))
        wait_until(lambda: server.pool("r").in_flight == 1, what="a slow call on the first worker")
        # Calls keep succeeding while the replacement starts and the first worker drains.
        deadline = time.monotonic() + 120
        n = 0
        while True:
            assert c.call(DIVIDE, 10, 2, affinity="hint") == 5
            n += 1
            if n % 10 == 0:
                workers = {w.id: w for w in server.pool("r").workers}
                if "r-0-g2" in workers and workers["r-0-g2"].state == "ready":
                    break
            assert time.monotonic() < deadline, "no replacement"
            time.sleep(0.01)
        # The old worker is draining: its slow call is still running, and it takes no new calls.
        workers = {w.id: w for w in server.pool("r").workers}
        assert workers["r-0-g1"].state == "draining" and workers["r-0-g1"].in_flight == 1
        assert c.call(PC, affinity="hint").worker_id == "r-0-g2"
        open_gates([gate])
        assert slow.done.wait(30) and slow.error is None, slow.error
        # Its calls are done, but a client still holds refs there (the config, and the group the slow
        # call returned): it stays, and calls on them keep reaching it until they are released.
        wait_until(lambda: server.pool("r").in_flight == 0, what="the slow call done")
        time.sleep(1.5)     # three of the drain's looks at the worker's refs
        workers = {w.id: w for w in server.pool("r").workers}
        assert workers["r-0-g1"].state == "draining" and workers["r-0-g1"].refs == 2
        assert c.call(Target.get(ref, "world_size")) == 1
        assert c.release(ref) == 1      # the router notes what the worker still holds
        assert {w.id: w.refs for w in server.pool("r").workers}["r-0-g1"] == 1
        assert c.release(slow.value) == 1
        wait_until(lambda: "r-0-g1" not in {w.id for w in server.pool("r").workers}, timeout=30,
                   what="the recycled worker gone")
        wait_until(lambda: not group_members(first.pid), timeout=5, what="its process group gone")
        assert server.pool("r").restarts == 0     # a recycle is not a crash


def test_a_recycled_worker_whose_refs_are_kept_past_the_drain_timeout_stops_and_they_are_lost(
        server: PoolServer) -> None:
    with server.client(pool="rt") as c:
        ref = c.call(PC)
        assert ref.worker_id == "rt-0-g1"
        assert [c.call(DIVIDE, 8, 2) for _ in range(2)] == [4, 4]      # its 3rd call: due for recycling
        wait_until(lambda: "rt-0-g1" not in {w.id for w in server.pool("rt").workers}, timeout=120,
                   what="the recycled worker gone after its 1 s drain")
        with pytest.raises(CallError) as err:
            c.call(Target.get(ref, "world_size"))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE and err.value.reason == "worker lost"
        assert ref.id in err.value.details and "recycled with 1 live ref" in err.value.details
        assert c.call(DIVIDE, 8, 2) == 4 and server.pool("rt").restarts == 0


CONFIG_SIGTERM = """
grace_s = 30
[[pools]]
name = "d"
workers = 1
max_concurrent = 4
"""


@pytest.mark.parametrize("loop", LOOPS)
def test_sigterm_lets_in_flight_calls_finish_then_every_process_is_gone(tmp_path: Path, loop: str) -> None:
    """On either event loop the server can run on: routing, signals and the graceful stop."""
    server = start_pool_server(tmp_path, CONFIG_SIGTERM, "--loop", loop)
    try:
        assert f"{loop} loop" in server.log_text()
        worker = server.pool("d").workers[0]
        sockets_dir = Path(worker.address.removeprefix("unix:")).parent
        assert sockets_dir.is_dir()
        gates = [Gate() for _ in range(3)]
        # a health watcher that never hangs up: told NOT_SERVING at the SIGTERM, then its stream ends
        # (held open, it kept the stopping server waiting out its whole grace period, 30 s here)
        watch_channel = grpc.insecure_channel(server.address)
        seen: list[object] = []

        def watch() -> None:
            try:
                for reply in health_pb2_grpc.HealthStub(watch_channel).Watch(health_pb2.HealthCheckRequest()):
                    seen.append(reply.status)
            except grpc.RpcError as err:
                seen.append(err.code())       # type: ignore[attr-defined]
        watcher = in_thread(watch)
        with server.client(pool="d") as c:
            calls = [in_thread(lambda g=g: c.call(*g.args())) for g in gates]
            wait_until(lambda: server.pool("d").in_flight == 3 and seen, what="3 calls in flight, and a watcher")
            server.proc.send_signal(signal.SIGTERM)
            time.sleep(1.0)
            # No new calls are taken, but the server waits for the ones in flight.
            with server.client(pool="d") as late, pytest.raises(CallError) as err:
                late.call(DIVIDE, 4, 2, timeout=5)
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            assert server.proc.poll() is None and psutil.pid_exists(worker.pid)
            open_gates(gates)
            for out in calls:
                assert out.done.wait(30) and out.error is None, out.error
        assert server.proc.wait(15) == 0          # well within its grace: the watcher held nothing up
        assert watcher.done.wait(5)
        assert seen == [health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING], seen
        watch_channel.close()
        wait_until(lambda: not group_members(worker.pid), timeout=5, what="the worker's group gone")
        assert not sockets_dir.exists()
    finally:
        server.stop()


def test_sigkill_of_the_server_takes_its_workers_and_their_engine_cores_along(tmp_path: Path) -> None:
    """Nobody is left to stop anything when the server is SIGKILLed: each worker learns of it (its
    parent-death signal) and kills its own process group, vLLM's engine core included."""
    from bridge_server.tools.tiny_model import ensure_tiny_model

    config = f"""
[[pools]]
name = "e"
workers = 1
[[pools.objects]]
name = "engine"
target = "vllm.AsyncLLMEngine.from_engine_args"
kwargs = {{ engine_args = {{ model = "{ensure_tiny_model()}", dtype = "float32", max_model_len = 256, enforce_eager = true }} }}
"""
    server = start_pool_server(tmp_path, config)
    group = server.pool("e").workers[0].pid
    try:
        assert len(group_members(group)) >= 2, "expected vLLM's engine core in the worker's process group"
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(10)
        wait_until(lambda: not group_members(group), timeout=15,
                   what="the worker and its engine core gone after the server's SIGKILL")
    finally:
        server.stop()
        kill_group(group)   # whatever the assertion found still running
