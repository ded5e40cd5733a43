"""The worker's lane (`bridge_server/worker/lane.py`) over a real unix socket to a real worker process: it
answers as the worker's own gRPC service does, and a bad peer loses its connection, not the worker."""

from __future__ import annotations

import asyncio
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_status import rpc_status

from bridge_server.client.client import BridgeClient
from bridge_server.pool.lane import LaneClosed, open_lane
from tests.conftest import WorkerProcess, start_worker
from tests.pool.harness import Gate, open_gates
from vllm_bridge.v1 import bridge_pb2 as pb

D = "vllm.distributed"
CALL = "/vllm_bridge.v1.Bridge/Call"


@pytest.fixture(scope="module")
def laned(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[WorkerProcess, str]]:
    tmp = tmp_path_factory.mktemp("lane")
    path = str(tmp / "w.lane")
    w = start_worker(tmp, "--lane", path, "--outside-ranks", "1", name="laned")   # the Gate's peer
    yield w, path
    w.stop()


def request(target: Any, *args: Any) -> bytes:
    with BridgeClient("127.0.0.1:1") as c:     # encodes only; never connects
        req, _ = c.request(target, args)
    return req.SerializeToString()


async def over_lane(path: str, calls: list[bytes], metadata: tuple[tuple[str, str], ...]) -> list[Any]:
    lane = await open_lane(path)
    try:
        running = [lane.start(call, metadata) for call in calls]     # all at once, on one connection
        return [await lc.next() for lc in running]
    finally:
        lane.close()


CASES = [
    ("a value", (f"{D}.get_pp_indices", 64, 1, 4)),
    ("unknown name", (f"{D}.devide", 6, 3)),
    ("too many args", (f"{D}.divide", 6, 3, 1)),
    ("wrong type", (f"{D}.divide", "six", 3)),
]


def test_the_lane_answers_every_call_as_the_grpc_service_does(laned: tuple[WorkerProcess, str]) -> None:
    worker, path = laned
    calls = [request(*case) for _, case in CASES]
    metadata = (("x-bridge-session", "lane-test"),)
    events = asyncio.run(over_lane(path, calls, metadata))
    with grpc.insecure_channel(worker.address) as channel:
        rpc = channel.unary_unary(CALL)
        for (name, _), call, event in zip(CASES, calls, events):
            try:
                reply = rpc(call, metadata=metadata)
            except grpc.RpcError as err:
                assert event.WhichOneof("kind") == "error", name
                assert event.error.code == err.code().value[0], name
                assert event.error.message == err.details(), name
                status = rpc_status.from_call(err)  # type: ignore[arg-type]
                assert status is not None
                detail = pb.ErrorDetail()
                status.details[0].Unpack(detail)
                assert (event.error.detail.category, event.error.detail.parameter, event.error.detail.target) == \
                    (detail.category, detail.parameter, detail.target), name
            else:
                assert event.WhichOneof("kind") == "value", name
                assert pb.CallReply.FromString(reply).value == pb.Value.FromString(event.value), name


def read_reply(s: socket.socket) -> pb.MuxReply:
    s.settimeout(10)
    head = b""
    while len(head) < 4:
        head += s.recv(4 - len(head))
    (size,) = struct.unpack("<I", head)
    body = b""
    while len(body) < size:
        body += s.recv(size - len(body))
    return pb.MuxReply.FromString(body)


def test_an_unreadable_request_fails_alone_and_the_connection_serves_on(laned: tuple[WorkerProcess, str]) -> None:
    """Bytes that are not a MuxRequest get an INVALID_ARGUMENT event, for the call they name when
    an id can be read (a bad call inside a start), else for id 0; the connection carries on."""
    worker, path = laned
    good = pb.MuxRequest(start=pb.MuxStart(id=2, call=pb.CallRequest.FromString(request(f"{D}.divide", 6, 3))))
    bad_call = pb.MuxRequestView(start=pb.MuxStartView(id=7, call=b"\x0a\x01")).SerializeToString()
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        for frame in (b"\xff\xff\xff not a MuxRequest", bad_call, good.SerializeToString()):
            s.sendall(struct.pack("<I", len(frame)) + frame)
        events: dict[int, pb.MuxEvent] = {}
        while len(events) < 3:
            events.update((e.id, e) for e in read_reply(s).events)
    for call_id in (0, 7):
        assert events[call_id].error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0], events[call_id]
    assert "not a valid vllm_bridge.v1.MuxRequest" in events[0].error.message, events[0]
    # the start itself is readable: its call is what is refused, by its id
    assert "call 7: the request is not a valid vllm_bridge.v1.CallRequest" in events[7].error.message, events[7]
    assert events[2].value.int == 2
    with socket.socket(socket.AF_UNIX) as s:    # a frame over the size limit: that peer is cut off
        s.connect(path)
        s.sendall(struct.pack("<I", 0xFFFFFFF0))
        s.settimeout(10)
        assert s.recv(1) == b""
    (event,) = asyncio.run(over_lane(path, [request(f"{D}.divide", 6, 3)], ()))
    assert pb.Value.FromString(event.value).int == 2
    with BridgeClient(worker.address) as c:
        assert c.call(f"{D}.divide", 6, 3) == 2


def test_the_time_a_call_has_left_ends_it_in_the_worker(laned: tuple[WorkerProcess, str]) -> None:
    """`time_left_ms` (what a router sends for a caller's deadline) is enforced by the worker: a
    blocked call ends with its DEADLINE_EXCEEDED error at that time. A negative one is refused."""
    worker, path = laned
    gate = Gate()

    async def run() -> tuple[Any, float]:
        lane = await open_lane(path)
        try:
            t0 = time.monotonic()
            event = await asyncio.wait_for(lane.start(request(*gate.args()), (), timeout_s=0.5).next(), 10)
            return event, time.monotonic() - t0
        finally:
            lane.close()

    try:
        event, took = asyncio.run(run())
    finally:
        open_gates([gate])      # the worker's thread, abandoned in C code, may finish now
    assert event.WhichOneof("kind") == "error", event
    assert event.error.code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0], event.error
    assert 0.4 < took < 3, took
    call = pb.CallRequest.FromString(request(f"{D}.divide", 6, 3))
    with grpc.insecure_channel(worker.address) as channel:
        replies = list(channel.stream_stream("/vllm_bridge.v1.Bridge/Multiplex", pb.MuxRequest.SerializeToString,
                                             pb.MuxReply.FromString)(
            iter([pb.MuxRequest(start=pb.MuxStart(id=1, call=call, time_left_ms=-5))])))
    (refused,) = [e for r in replies for e in r.events]
    assert refused.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "start.time_left_ms" in refused.error.message and "-5" in refused.error.message, refused.error


def test_a_call_running_when_the_worker_dies_raises_lane_closed(tmp_path: Path) -> None:
    path = str(tmp_path / "w.lane")
    worker = start_worker(tmp_path, "--lane", path, "--outside-ranks", "1", name="lane-dies")
    gate = Gate()     # a call that blocks in the worker until the gate opens (it never does here)

    async def run() -> BaseException | None:
        lane = await open_lane(path)
        waiting = asyncio.get_running_loop().create_task(lane.start(request(*gate.args()), ()).next())
        while not gate.running():
            await asyncio.sleep(0.05)
        worker.proc.kill()
        try:
            await asyncio.wait_for(waiting, 10)
        except BaseException as exc:   # noqa: BLE001 - what it raises is the point
            return exc
        return None

    try:
        err = asyncio.run(run())
    finally:
        worker.stop()
    assert isinstance(err, LaneClosed), repr(err)


def test_frames_split_anywhere_by_the_socket_are_put_back_together() -> None:
    """The unit of the framing alone: a large frame and small ones, cut into chunks at arbitrary
    points (as a socket delivers them), come out whole and in order."""
    import random

    from bridge_server.wire.framing import Framed as _Framed

    got: list[bytes] = []
    framed = _Framed(got.append, lambda reason: got.append(b"LOST " + reason.encode()))
    frames = [bytes(random.Random(1).randbytes(5 * 1024 * 1024)), b"", b"small", b"x" * 70_000]
    wire = b"".join(struct.pack("<I", len(f)) + f for f in frames)
    rng = random.Random(7)
    pos = 0
    while pos < len(wire):
        step = rng.choice([1, 3, 4, 5, 1000, 65536, 1 << 20])
        framed.data_received(wire[pos:pos + step])
        pos += step
    assert got == frames


def test_a_start_is_sent_in_parts_that_read_as_one_request() -> None:
    """The unit of the router's start message alone: the call (with the time it has left) and its
    options (encoded once per set) are concatenated, and the worker reads them as one `MuxRequest`
    with the caller's x-bridge-* options only, and each call's own time left."""
    from bridge_server.pool.lane import Lane

    class Wire:
        def __init__(self) -> None:
            self.frames: list[bytes] = []

        def write(self, data: bytes) -> None:
            (size,) = struct.unpack_from("<I", data)
            assert size == len(data) - 4
            self.frames.append(data[4:])

    wire = Wire()
    lane = Lane("unused")
    lane.framed.connection_made(wire)   # type: ignore[arg-type]
    call = request(f"{D}.divide", 6, 3)
    md = (("x-bridge-session", "s1"), ("x-bridge-timeout-ms", "60000"), ("user-agent", "grpc-python"))
    lane.start(call, md, timeout_s=1.5)
    lane.start(call, md, stream=True, window=8, timeout_s=0.25)    # the same options, another time left
    lane.start(call, md)                                            # no deadline of the router's own
    first, second, third = (pb.MuxRequest.FromString(f).start for f in wire.frames)
    assert (first.id, first.stream, first.window, first.call.SerializeToString()) == (1, False, 0, call)
    assert (second.id, second.stream, second.window) == (2, True, 8)
    assert [s.time_left_ms for s in (first, second, third)] == [1500.0, 250.0, 0.0]
    for start in (first, second, third):
        assert dict(start.metadata) == {"x-bridge-session": "s1", "x-bridge-timeout-ms": "60000"}


def test_a_large_call_waits_in_the_lane_until_what_went_before_it_has_gone() -> None:
    """The lane is one ordered byte stream: thirty 60 MiB calls written at once put 1.8 GB in the pool
    server's write buffer, and another client's 6/3 behind them waited 17-29 s. A large call is
    written once what went before it has gone (the hosts of its senders taking turns, its time left
    counted from then); a small one goes at once, behind one large call at most; one cancelled
    before it was written never is, and its caller hears CANCELLED from the lane."""
    from bridge_server.pool.lane import Lane
    from bridge_server.wire.protocol import LARGE_REQUEST_BYTES

    big = [request(f"{D}.divide", bytes([i]) * (2 * LARGE_REQUEST_BYTES), 1) for i in range(6)]
    small = request(f"{D}.divide", 6, 3)
    first_host, second_host = "ipv4:10.0.0.1:5000", "ipv4:10.0.0.2:5000"

    def read_frames(sock: socket.socket, count: int) -> list[pb.MuxRequest]:
        def exactly(n: int) -> bytes:
            data = bytearray()
            while len(data) < n:
                chunk = sock.recv(n - len(data))
                assert chunk, "the lane closed"
                data += chunk
            return bytes(data)
        return [pb.MuxRequest.FromString(exactly(struct.unpack("<I", exactly(4))[0])) for _ in range(count)]

    async def main() -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        lane = Lane("socketpair")
        await asyncio.get_running_loop().create_unix_connection(lambda: lane.framed, sock=ours)
        try:
            calls = [lane.start(big[i], (), timeout_s=30, client=host)
                     for i, host in enumerate([first_host] * 3 + [second_host] * 3)]
            assert lane.framed.paused            # the first went out, and the peer has not read it
            assert [lc.unsent is None for lc in calls] == [True] + [False] * 5
            assert lane.framed.transport is not None
            assert lane.framed.transport.get_write_buffer_size() <= len(big[0]) + 1024
            quick = lane.start(small, (), timeout_s=30, client=second_host)
            assert quick.unsent is None          # written at once, behind the one large call
            calls[5].cancel()                    # never written
            calls[4].ask_to_cancel()             # never written: the lane says CANCELLED
            event = await asyncio.wait_for(calls[4].next(), 5)
            assert event.WhichOneof("kind") == "error" and event.error.code == grpc.StatusCode.CANCELLED.value[0]
            await asyncio.sleep(0.5)             # time the waiting calls spend in the lane
            theirs.setblocking(True)
            frames = await asyncio.to_thread(read_frames, theirs, 5)
        finally:
            lane.close()
            theirs.close()
        starts = [f.start for f in frames]
        by_payload = {b: i for i, b in enumerate(big)}
        order = [by_payload.get(s.call.SerializeToString(), "small") for s in starts]
        # the first large call, the small one, then the hosts that waited in turn (10.0.0.1 waited
        # first), less the two cancelled calls: 10.0.0.2's one goes between 10.0.0.1's two
        assert order == [0, "small", 1, 3, 2], order
        assert [s.id for s in starts] == [calls[0].id, quick.id, calls[1].id, calls[3].id, calls[2].id]
        # a call's time left is what it has when it is written
        assert starts[0].time_left_ms == 30_000 and all(0 < s.time_left_ms < 29_500 for s in starts[2:])

    asyncio.run(main())
