"""Shared fixtures: real worker processes over real sockets.

Workers are started the way a user or supervisor starts them (`vllm-bridge worker`), one per test
session where the tests can share it, because importing vLLM and building the catalog costs seconds.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared"

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class WorkerProcess:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def wait_healthy(address: str, proc: subprocess.Popen[bytes] | None, log: Path | None, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"process exited with {proc.returncode}:\n{log.read_text() if log else ''}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy after {timeout} s:\n{log.read_text() if log else ''}")


def start_worker(tmp: Path, *extra: str, name: str = "worker") -> WorkerProcess:
    port = free_port()
    address = f"127.0.0.1:{port}"
    log = tmp / f"{name}-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "bridge_server.cli", "worker", "--listen", address, *extra],
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(address, proc, log)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    return WorkerProcess(proc, address, log)


@pytest.fixture(scope="session")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    w = start_worker(tmp_path_factory.mktemp("worker"), "--ref-ttl", "600")
    yield w
    w.stop()


@pytest.fixture()
def client(worker: WorkerProcess) -> Iterator[object]:
    from bridge_server.client.client import BridgeClient
    with BridgeClient(worker.address) as c:
        yield c


def _pp_start(call_id: int, *args: int) -> pb.MuxRequest:
    call = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.get_pp_indices"),
                          args=[pb.Value(int=a) for a in args])
    return pb.MuxRequest(start=pb.MuxStart(id=call_id, call=call))


def multiplex_batches(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """A check for the worker's Multiplex and the pool server's alike. Starts sent as MuxBatches run as if each had come alone, a bad request in a batch fails only
    its own call, and a batch inside a batch is refused (id 0) without harm to the rest."""
    batch = pb.MuxRequest(batch=pb.MuxBatch(requests=[_pp_start(i, 64, i % 4, 4) for i in range(1, 33)]))
    bad = pb.MuxRequest(batch=pb.MuxBatch(requests=[
        _pp_start(40, 64, 1, 4),
        pb.MuxRequest(batch=pb.MuxBatch(requests=[_pp_start(41, 64, 2, 4)])),   # nested: refused
        _pp_start(42, 64, 9, 4),                                               # fails on its own
        pb.MuxRequest(cancel=999),                                             # names nothing: ignored
        _pp_start(43, 64, 3, 4)]))
    # Larger than the slice a server handles before its loop turns, and within the share of a pool's
    # queue that one client may take (all of them may wait at once): all handled.
    many = pb.MuxRequest(batch=pb.MuxBatch(requests=[_pp_start(i, 64, i % 4, 4) for i in range(100, 400)]))
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.BridgeStub(channel).Multiplex(iter([batch, bad, many]), metadata=metadata))
    events = [e for r in replies for e in r.events]
    got = {e.id: e for e in events}
    for i in range(100, 400):
        e = got.pop(i)
        assert tuple(v.int for v in e.value.tuple.items) == ((i % 4) * 16, (i % 4) * 16 + 16), e
    assert sorted(got) == [0, *range(1, 33), 40, 42, 43]
    for i in range(1, 33):
        assert tuple(v.int for v in got[i].value.tuple.items) == ((i % 4) * 16, (i % 4) * 16 + 16)
    assert got[0].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "not another batch" in got[0].error.message
    assert got[42].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], got[42]
    assert tuple(v.int for v in got[40].value.tuple.items) == (16, 32)
    assert tuple(v.int for v in got[43].value.tuple.items) == (48, 64)
