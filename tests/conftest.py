"""Shared fixtures: real worker processes over real sockets.

Workers are started the way a user or supervisor starts them (`vllm-bridge worker`), one per test
session where the tests can share it, because importing vLLM and building the catalog costs seconds.
"""

from __future__ import annotations

import os
import queue
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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


def unread_multiplex(address: str, metadata: tuple[tuple[str, str], ...]
                     ) -> tuple[grpc.Channel, Any, queue.Queue[Any]]:
    """A raw Multiplex stream on a connection of its own whose replies nobody reads (HTTP/2's first
    64 KiB window, not one grown to the link, so a few whole items fill it): its channel, its reply
    iterator, and the queue its requests are put in (None ends them)."""
    outgoing: queue.Queue[Any] = queue.Queue()
    channel = grpc.insecure_channel(address, options=[("grpc.http2.bdp_probe", 0)])
    replies = channel.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                    pb.MuxReply.FromString)(iter(outgoing.get, None), timeout=120, metadata=metadata)
    return channel, replies, outgoing


def multiplex_clients_leave_blocked(address: str, metadata: tuple[tuple[str, str], ...], clients: int,
                                    start: Callable[[int, int], pb.CallRequest], blocked: Callable[[], None]) -> None:
    """`clients` raw Multiplex streams that each start streaming calls 1-4 (`start(client, i)`) and
    credit them without reading a reply; once `blocked()` returns (their writes held back), each
    starts calls 5-8, and all go: their RPCs cancelled, their connections closed."""
    streams = []
    try:
        for c in range(clients):
            channel, replies, outgoing = unread_multiplex(address, metadata)
            streams.append((channel, replies, outgoing))
            for i in range(1, 5):
                outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=i, stream=True, window=8, call=start(c, i))))
                outgoing.put(pb.MuxRequest(credit=pb.MuxCredit(id=i, events=1_000_000)))
        blocked()
        for c, (_, _, outgoing) in enumerate(streams):     # more starts, read as the clients leave
            for i in range(5, 9):
                outgoing.put(pb.MuxRequest(start=pb.MuxStart(id=i, stream=True, window=8, call=start(c, i))))
    finally:
        for channel, replies, outgoing in streams:
            replies.cancel()
            outgoing.put(None)
            channel.close()


def _pp_start(call_id: int, *args: int) -> pb.MuxRequest:
    call = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.get_pp_indices"),
                          args=[pb.Value(int=a) for a in args])
    return pb.MuxRequest(start=pb.MuxStart(id=call_id, call=call))


def multiplex_batches(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """A check for the worker's Multiplex and the pool server's alike. Starts sent as MuxBatches run
    as if each had come alone, a bad request in a batch fails only its own call, and a batch inside a
    batch is refused (id 0) without harm to the rest."""
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
    # Requests that name no call are refused under id 0, the same refusal once per reply: a batch of
    # 65,536 empty requests got as many events, 77 times the bytes it took to send them.
    empty = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest()] * 1000 + [_pp_start(700, 64, 1, 4)]))
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.BridgeStub(channel).Multiplex(iter([empty]), metadata=metadata, timeout=30))
    events = [e for r in replies for e in r.events]
    refusals = [e for e in events if e.id == 0]
    assert 1 <= len(refusals) <= 1000 // 64 + 1, len(refusals)
    assert all("must hold start" in e.error.message for e in refusals)
    assert [e.id for e in events if e.id] == [700]
    # A start cancelled in the batch that starts it never runs: it is answered CANCELLED all the same
    # (it went unanswered, holding its worker slot for as long as the connection lived).
    gone = [pb.MuxRequest(start=pb.MuxStart(id=i, call=_pp_start(i, 64, 1, 4).start.call, stream=True))
            for i in range(500, 564)]
    cancels = pb.MuxRequest(batch=pb.MuxBatch(requests=[r for g in gone for r in (g, pb.MuxRequest(cancel=g.start.id))]
                                              + [_pp_start(600, 64, 2, 4)]))
    with grpc.insecure_channel(address) as channel:
        replies = list(pb_grpc.BridgeStub(channel).Multiplex(iter([cancels]), metadata=metadata, timeout=30))
    got = {e.id: e for r in replies for e in r.events}
    assert sorted(got) == [*range(500, 564), 600], sorted(got)
    # (through the pool server a start may reach its worker, and run, before its cancel: then it ends)
    ended = [i for i in range(500, 564) if got[i].error.code == grpc.StatusCode.CANCELLED.value[0]
             or got[i].WhichOneof("kind") == "end"]
    assert ended == list(range(500, 564)), [got[i] for i in range(500, 564) if i not in ended][:1]
    assert tuple(v.int for v in got[600].value.tuple.items) == (32, 48)


def _varint(n: int) -> bytes:
    out = b""
    while True:
        low, n = n & 0x7F, n >> 7
        if not n:
            return out + bytes([low])
        out += bytes([low | 0x80])


def large_requests(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
    """A check for the worker and the pool server alike. A request of LARGE_REQUEST_BYTES or more
    is not parsed whole where it is read (a message of many tiny values held the reader's loop for
    seconds): its values are parsed in the caller's turn. So bytes that are not a CallRequest deep
    inside a large call fail that call alone, in a Multiplex batch as over Call, and the calls
    beside it in the batch run."""
    from bridge_server.wire.protocol import LARGE_REQUEST_BYTES

    # args[0]: a list of 150,000 empty values, then one whose length runs past the end
    items = b"\x0a\x00" * 150_000 + b"\x0a\x05\x01"
    broken = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.divide"))
    raw = broken.SerializeToString() + b"\x12" + _varint(len(items) + 1 + len(_varint(len(items)))) + \
        b"\x42" + _varint(len(items)) + items
    assert len(raw) >= LARGE_REQUEST_BYTES
    text = pb.CallRequest(target=broken.target, args=[pb.Value(list=pb.Items(items=[pb.Value(str="x")] * 100_000)),
                                                      pb.Value(int=1)])
    pp = pb.Target(kind=pb.Target.FUNCTION, name="vllm.distributed.get_pp_indices")
    calls = [pb.CallRequest(target=pp, args=[pb.Value(int=a) for a in (64, 1, 4)]).SerializeToString(),
             raw,                             # fails alone, in its turn
             text.SerializeToString(),        # parsed and decoded in its turn: not a number
             pb.CallRequest(target=pp, args=[pb.Value(int=a) for a in (64, 3, 4)]).SerializeToString()]
    # As views: a protobuf message cannot hold the broken call.
    wire = pb.MuxRequestView(batch=pb.MuxBatchView(requests=[
        pb.MuxRequestView(start=pb.MuxStartView(id=i, call=call)) for i, call in enumerate(calls, 1)]))
    with grpc.insecure_channel(address) as channel:
        with pytest.raises(grpc.RpcError) as err:
            channel.unary_unary("/vllm_bridge.v1.Bridge/Call")(raw, metadata=metadata, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value      # type: ignore[attr-defined]
        assert "not a valid vllm_bridge.v1.CallRequest" in err.value.details()    # type: ignore[attr-defined]
        replies = list(channel.stream_stream("/vllm_bridge.v1.Bridge/Multiplex")(
            iter([wire.SerializeToString()]), metadata=metadata, timeout=60))
    got = {e.id: e for r in replies for e in pb.MuxReply.FromString(r).events}
    assert sorted(got) == [1, 2, 3, 4], got
    assert tuple(v.int for v in got[1].value.tuple.items) == (16, 32)
    assert tuple(v.int for v in got[4].value.tuple.items) == (48, 64)
    assert got[2].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], got[2]
    assert "not a valid vllm_bridge.v1.CallRequest" in got[2].error.message, got[2]
    assert got[3].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], got[3]
    assert "numerator" in got[3].error.message, got[3]
    # A large call of more arguments than MAX_CALL_FIELDS (here: empty ones, 2 bytes each) is refused
    # before anything parses it; thirty million of them took the pool server to 7 GB.
    from bridge_server.wire.protocol import MAX_CALL_FIELDS
    many = broken.SerializeToString() + b"\x12\x00" * (LARGE_REQUEST_BYTES // 2)
    assert LARGE_REQUEST_BYTES // 2 > MAX_CALL_FIELDS
    with grpc.insecure_channel(address) as channel:
        for rpc in ("Call", "Stream"):
            with pytest.raises(grpc.RpcError) as err:
                list(channel.unary_stream("/vllm_bridge.v1.Bridge/Stream")(many, metadata=metadata, timeout=30)) \
                    if rpc == "Stream" else channel.unary_unary("/vllm_bridge.v1.Bridge/Call")(
                        many, metadata=metadata, timeout=30)
            assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value      # type: ignore[attr-defined]
            assert f"more than {MAX_CALL_FIELDS:,} arguments" in err.value.details()    # type: ignore[attr-defined]
    # A batch of more requests than MUX_MAX_BATCH ends its stream, with none of them handled.
    from bridge_server.wire.protocol import MUX_MAX_BATCH
    many = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest(cancel=i + 1) for i in range(MUX_MAX_BATCH + 1)]))
    with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as err:
        list(pb_grpc.BridgeStub(channel).Multiplex(iter([many]), metadata=metadata, timeout=60))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value     # type: ignore[attr-defined]
    assert f"over the limit of {MUX_MAX_BATCH:,}" in err.value.details()         # type: ignore[attr-defined]
