"""What the pool server reads at once: requests in receipt are bounded, in all and per host, a
sender that stops halfway gives its place back, and one host holds a bounded number of request
streams (`wire/receiving.py`). Over real gRPC sockets, against a real pool server."""

from __future__ import annotations

import asyncio
import queue
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.client.client import BridgeClient, CallError
from bridge_server.wire.receiving import IDENTITY, ReceiveLimits, _Places
from tests.pool.harness import PoolServer, start_pool_server
from vllm_bridge.v1 import bridge_pb2 as pb

MAX_REQUEST = 16 * 2**20
CALL = "/vllm_bridge.v1.Bridge/Call"
MULTIPLEX = "/vllm_bridge.v1.Bridge/Multiplex"
OWN = [("grpc.use_local_subchannel_pool", 1)]     # a connection of its own


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """Requests of 16 MiB at most; 64 MiB of them in receipt at once (4 requests, 1 per host: every
    client here is this machine, one host); 2 s for a request to arrive; 4 request streams a host."""
    tmp = tmp_path_factory.mktemp("receiving")
    config = f"""
max_request_bytes = {MAX_REQUEST}
max_receiving_bytes = {4 * MAX_REQUEST}
max_unread_bytes = {32 * 2**20}
receive_s = 2
streams_per_host = 4
[[pools]]
name = "p"
workers = 1
"""
    s = start_pool_server(tmp, config)
    yield s
    s.stop()


AVAILABLE = "vllm.forward_context.is_forward_context_available"    # a cheap call any pool answers


def serves(server: PoolServer) -> bool:
    with BridgeClient(server.address, channel_options=OWN) as c:
        return c.call(AVAILABLE, timeout=30) is False


def health(server: PoolServer) -> int:
    with grpc.insecure_channel(server.address) as ch:
        return int(health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status)


def test_many_large_requests_at_once_are_read_a_few_at_a_time(server: PoolServer) -> None:
    """48 requests of 15 MiB sent at once over one connection. gRPC read every one whole before any
    handler ran (~25 MB each in the server: 32 requests of 60 MiB took it to 3.2 GB); read a place at a
    time, the server grows by what its places and its bound on large requests hold, and then serves on."""
    process = psutil.Process(server.proc.pid)
    blob = b"\x0a" + b"\x00" * (15 * 2**20)     # a call of ~16 million empty arguments: refused, by count
    peak = [0]
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], process.memory_info().rss)
            time.sleep(0.01)

    async def send() -> list[grpc.StatusCode]:
        async with grpc.aio.insecure_channel(server.address,
                                             options=[("grpc.max_send_message_length", 32 * 2**20)]) as ch:
            call = ch.unary_unary(CALL)

            async def one() -> grpc.StatusCode:
                try:
                    await call(blob, timeout=120)
                    return grpc.StatusCode.OK
                except grpc.aio.AioRpcError as err:
                    return err.code()
            return list(await asyncio.gather(*(one() for _ in range(48))))

    before = process.memory_info().rss
    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        codes = asyncio.run(send())
    finally:
        done.set()
        watcher.join()
    assert set(codes) == {grpc.StatusCode.RESOURCE_EXHAUSTED}, codes
    grown = peak[0] - before
    # 1 place here (~25 MB) and 32 MiB of large requests held while they are parsed, with room to
    # spare; all 48 read at once is 1.2 GB and more
    assert grown < 400 * 2**20, f"the pool server grew by {grown / 2**20:.0f} MiB"
    assert health(server) == health_pb2.HealthCheckResponse.SERVING and serves(server)


def test_a_request_that_does_not_arrive_gives_its_place_back_within_receive_s(server: PoolServer) -> None:
    """A caller opens a Call and sends nothing (as one that stops halfway through a large request):
    it holds the one place this host has. The next Call from the same host waits for it, and the
    first ends with RESOURCE_EXHAUSTED naming receive_s, after 2 s, not at its own far deadline."""
    outgoing: queue.Queue[Any] = queue.Queue()
    with grpc.insecure_channel(server.address) as ch:
        stalled = ch.stream_unary(CALL).future(iter(outgoing.get, None), timeout=60)
        time.sleep(0.5)       # its place taken
        t0 = time.monotonic()
        assert serves(server)
        waited = time.monotonic() - t0
        with pytest.raises(grpc.RpcError) as err:
            stalled.result(timeout=30)
        outgoing.put(None)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value    # type: ignore[attr-defined]
    assert "did not arrive within 2 s (receive_s)" in err.value.details(), err.value   # type: ignore[attr-defined]
    assert waited < 10, waited     # it was served once the stalled one gave its place back


def test_a_call_that_ends_without_its_request_is_refused_by_name(server: PoolServer) -> None:
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.stream_unary(CALL)(iter(()), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value      # type: ignore[attr-defined]
    assert "Call: expected one request message, got none" in err.value.details()  # type: ignore[attr-defined]


@pytest.mark.parametrize("method", [CALL, "/grpc.health.v1.Health/Check"])
def test_a_unary_call_with_a_second_request_is_refused_by_name(server: PoolServer, method: str) -> None:
    """A unary method takes one request: a second (here garbage) was ignored and the first answered."""
    one = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name=AVAILABLE)).SerializeToString() \
        if method == CALL else health_pb2.HealthCheckRequest().SerializeToString()
    with grpc.insecure_channel(server.address) as ch:
        with pytest.raises(grpc.RpcError) as err:
            ch.stream_unary(method)(iter((one, b"\xff\xff")), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value      # type: ignore[attr-defined]
        assert "expected one request message, got more" in err.value.details()    # type: ignore[attr-defined]
        assert ch.stream_unary(method)(iter((one,)), timeout=10)                   # one is answered


def test_one_host_holds_at_most_streams_per_host_request_streams(server: PoolServer) -> None:
    """Four Multiplex streams open from this host; the fifth is refused by name (each stream reads a
    message as it comes, up to max_request_bytes, for as long as it lives). Closing one lets another
    open and serve."""
    channels, queues, replies = [], [], []
    try:
        for _ in range(4):
            ch = grpc.insecure_channel(server.address)
            out: queue.Queue[Any] = queue.Queue()
            replies.append(ch.stream_stream(MULTIPLEX, pb.MuxRequest.SerializeToString, pb.MuxReply.FromString)(
                iter(out.get, None), timeout=60))
            channels.append(ch)
            queues.append(out)
        time.sleep(1.0)     # all four open
        with BridgeClient(server.address, channel_options=OWN) as c:
            with pytest.raises(CallError) as err, c.multiplex() as mux:
                mux.call(AVAILABLE, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
        assert "streams_per_host 4" in err.value.details, err.value.details
        queues[0].put(None)
        replies[0].cancel()
        channels[0].close()
        time.sleep(0.5)
        with BridgeClient(server.address, channel_options=OWN) as c, c.multiplex() as mux:
            assert mux.call(AVAILABLE, timeout=10) is False
    finally:
        for out, reply, ch in zip(queues, replies, channels):
            out.put(None)
            reply.cancel()
            ch.close()


def test_a_silent_multiplex_stream_keeps_nothing_of_the_request_it_sent_last(tmp_path: Path) -> None:
    """Eight Multiplex streams each send one 40 MiB request, get its answer, and then send nothing.
    gRPC's reader kept the last message it gave until it gave the next, so each silent stream held
    its request for as long as it stayed open (32 streams of 60 MiB from one host: 1.9 GB, counted
    nowhere). Answered, the requests are let go while the streams stay open. (Requests over 32 MiB:
    the allocator gives their memory back at once, so the server's size shows what is kept.)"""
    big = 48 * 2**20
    server = start_pool_server(tmp_path, f"""
max_request_bytes = {big}
max_unread_bytes = {512 * 2**20}
streams_per_host = 8
[[pools]]
name = "p"
workers = 1
""")
    channels, queues = [], []
    try:
        process = psutil.Process(server.proc.pid)
        before = process.memory_info().rss
        start = pb.MuxRequest(start=pb.MuxStart(id=1, call=pb.CallRequest(
            target=pb.Target(kind=pb.Target.FUNCTION, name=AVAILABLE), args=[pb.Value(bytes=b"\x07" * (40 * 2**20))])))
        answers, calls = [], []
        for _ in range(8):
            ch = grpc.insecure_channel(server.address, options=[*OWN, ("grpc.max_send_message_length", big)])
            out: queue.Queue[Any] = queue.Queue()
            out.put(start)
            replies = ch.stream_stream(MULTIPLEX, pb.MuxRequest.SerializeToString, pb.MuxReply.FromString)(
                iter(out.get, None), timeout=120)
            channels.append(ch)
            queues.append(out)
            calls.append(replies)      # kept: a call no one holds is cancelled
            answers.append(next(replies).events[0])
        assert all(a.id == 1 and "positional" in a.error.message for a in answers), answers   # refused by binding
        held = process.memory_info().rss - before
        deadline = time.monotonic() + 15
        while held > 120 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.5)
            held = process.memory_info().rss - before
        assert held <= 120 * 2**20, f"eight silent streams hold {held / 2**20:.0f} MiB of the pool server"
        assert serves(server)
    finally:
        for out in queues:
            out.put(None)
        for ch in channels:
            ch.close()
        server.stop()


# ------------------------------------------------------------------------------ stalled senders, strangers
TOKEN = "alice-token-0123456789abcdef"
OTHERS = {name: f"{name}-token-0123456789abcdef" for name in ("bob", "carol", "dave")}


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PoolServer]:
    """Tokens (alice, bob, carol, dave); 4 places, 1 a host or identity; 30 s for a request to arrive,
    but 1 s to hold a place while another host waits for one; 2 request streams a host or identity."""
    tmp = tmp_path_factory.mktemp("gated")
    (tmp / "tokens").write_text(f"alice:{TOKEN}\n" + "".join(f"{n}:{t}\n" for n, t in OTHERS.items()))
    (tmp / "tokens").chmod(0o600)
    s = start_pool_server(tmp, f"""
token_file = "{tmp / 'tokens'}"
max_request_bytes = {MAX_REQUEST}
max_receiving_bytes = {4 * MAX_REQUEST}
receive_s = 30
stall_s = 1
streams_per_host = 2
[[pools]]
name = "p"
workers = 1
""", token=TOKEN)
    yield s
    s.stop()


def _stalled(ch: grpc.Channel, method: str, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    """A call that sends its headers and then nothing, as one that stopped before its request."""
    outgoing: queue.Queue[Any] = queue.Queue()
    call = ch.stream_unary(method).future(iter(outgoing.get, None), timeout=60, metadata=metadata)
    call.outgoing = outgoing
    return call


def test_a_call_that_sends_nothing_holds_its_place_only_while_others_wait(gated: PoolServer) -> None:
    """Calls that sent their headers and nothing more held their host's places for all of receive_s,
    so that every other call of their address (its health checks, its authenticated callers') waited
    30 s and was then told its own request had not arrived; four addresses' would have held every
    place. A caller with a token counts as its identity, not its address; and a place held while
    another host waits for one goes to it after stall_s."""
    check = "/grpc.health.v1.Health/Check"
    with grpc.insecure_channel(gated.address, options=OWN) as ch:
        stalled = [_stalled(ch, check)]          # no token (health answers anyone): this address's place
        time.sleep(0.5)
        with BridgeClient(gated.address, token=TOKEN, channel_options=OWN) as alice:   # her identity's place
            assert alice.call(AVAILABLE, timeout=30) is False
        assert not stalled[0].done(), "alice waited for the stalled call of her address, and it was ended"
        stalled += [_stalled(ch, check, (("authorization", f"Bearer {t}"),)) for t in OTHERS.values()]
        time.sleep(0.5)                          # every place held: bob's, carol's, dave's, the address's
        t0 = time.monotonic()
        with BridgeClient(gated.address, token=TOKEN, channel_options=OWN) as alice:
            assert alice.call(AVAILABLE, timeout=30) is False     # ... until one has held it stall_s
        waited = time.monotonic() - t0
        deadline = time.monotonic() + 10
        while not any(call.done() for call in stalled) and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)                          # a sweep more: no other is ended, as nobody else waits
        ended = [call for call in stalled if call.done()]       # the one whose place alice was given
        for call in stalled:
            call.outgoing.put(None)
            if not call.done():
                call.cancel()
    assert waited < 10, waited                   # stall_s, not receive_s
    assert len(ended) == 1, ended
    with pytest.raises(grpc.RpcError) as err:
        ended[0].result()
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value       # type: ignore[attr-defined]
    assert "had not arrived 1 s (stall_s) after it was given a place" in err.value.details(), \
        err.value.details()                      # type: ignore[attr-defined]


def test_a_call_without_a_token_is_refused_before_anything_is_read(gated: PoolServer) -> None:
    """A call the server will refuse for want of a token was given a place, and read, first: callers
    without a token stalled the places of those with one. It is refused at once, sent or not."""
    with grpc.insecure_channel(gated.address, options=OWN) as ch:
        calls = [_stalled(ch, CALL) for _ in range(8)]       # read, they would wait receive_s (30 s)
        for call in calls:
            with pytest.raises(grpc.RpcError) as err:
                call.result(timeout=20)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value    # type: ignore[attr-defined]
            call.outgoing.put(None)
    with BridgeClient(gated.address, token=TOKEN, channel_options=OWN) as alice:
        assert alice.call(AVAILABLE, timeout=30) is False


def test_streams_without_a_token_leave_those_with_one_their_own(gated: PoolServer) -> None:
    """Reflection answers without a token, and its streams counted in their address's share of
    request streams, which Multiplex shares: 32 idle reflection streams of a stranger left every
    authenticated client of the same address without a Multiplex stream. A caller with a token has
    its identity's share."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
    channels, queues, calls = [], [], []
    try:
        for _ in range(2):            # the address's whole share, no token
            ch = grpc.insecure_channel(gated.address, options=OWN)
            out: queue.Queue[Any] = queue.Queue()
            out.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            replies = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(iter(out.get, None), timeout=60)
            assert next(replies).list_services_response.service
            channels.append(ch)
            queues.append(out)
            calls.append(replies)     # kept open
        with BridgeClient(gated.address, token=TOKEN, channel_options=OWN) as alice, alice.multiplex() as mux:
            assert mux.call(AVAILABLE, timeout=10) is False
        with pytest.raises(grpc.RpcError) as err:     # the address's third: refused by name
            ch = grpc.insecure_channel(gated.address, options=OWN)
            channels.append(ch)
            next(reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value    # type: ignore[attr-defined]
    finally:
        for out in queues:
            out.put(None)
        for call in calls:
            call.cancel()
        for ch in channels:
            ch.close()


def _frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return len(payload).to_bytes(3, "big") + bytes([kind, flags]) + stream.to_bytes(4, "big") + payload


def _hpack_int(value: int, bits: int) -> bytes:
    top = (1 << bits) - 1
    if value < top:
        return bytes([value])
    out, value = [top], value - top
    while value >= 128:
        out.append(value & 127 | 128)
        value >>= 7
    return bytes([*out, value])


def _literal(name: str, value: str) -> bytes:
    """A header as an HPACK literal without indexing, neither part Huffman-coded."""
    return b"\x00" + _hpack_int(len(name), 7) + name.encode() + _hpack_int(len(value), 7) + value.encode()


def test_metadata_past_grpcs_limit_is_refused_before_the_client_acknowledges_settings(gated: PoolServer) -> None:
    """gRPC applies its 16 KiB limit on a call's metadata only once the client has acknowledged the
    server's HTTP/2 settings: until then headers of megabytes reached the services, and a health
    Watch kept them for as long as its connection stayed open (600 of 2 MB: 1 GB of the pool server).
    Over a raw connection that never acknowledges, a Watch with 1 MB of headers is ended at once
    (trailers only, no reply), and the server serves on."""
    host, port = gated.address.rsplit(":", 1)
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Watch"),
        (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers"),
        ("x-pad", "a" * 1_000_000)))
    chunks = [headers[i:i + 16384] for i in range(0, len(headers), 16384)]
    wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"") + _frame(1, 0, 1, chunks[0])
    for i, chunk in enumerate(chunks[1:], 2):
        wire += _frame(9, 4 if i == len(chunks) else 0, 1, chunk)
    wire += _frame(0, 1, 1, b"\x00\x00\x00\x00\x00")      # an empty HealthCheckRequest, and the end
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(wire)
        sock.settimeout(0.5)
        got, frames, deadline = b"", [], time.monotonic() + 10
        while time.monotonic() < deadline and not any(f[:3] in ((1, 1, 1), (3, 0, 1)) or f[0] == 3 and f[2] == 1
                                                      for f in frames):
            try:
                more = sock.recv(1 << 16)
            except TimeoutError:
                continue
            if not more:
                break
            got += more
            while len(got) >= 9 and len(got) >= 9 + int.from_bytes(got[:3], "big"):
                size = int.from_bytes(got[:3], "big")
                frames.append((got[3], got[4] & 1, int.from_bytes(got[5:9], "big") & 0x7FFFFFFF))
                got = got[9 + size:]
    on_watch = [f for f in frames if f[2] == 1]
    assert not any(kind == 0 for kind, _, _ in on_watch), on_watch           # no reply was sent
    assert any(kind == 1 and end or kind == 3 for kind, end, _ in on_watch), on_watch   # the call ended
    assert health(gated) == health_pb2.HealthCheckResponse.SERVING


def test_a_connection_that_never_acknowledges_settings_is_closed_with_what_it_sent(gated: PoolServer) -> None:
    """Headers the services never see (`:authority`, `grpc-trace-bin`) are not counted by the gate,
    and before a client acknowledges the server's settings gRPC lets a header list be 16 MiB: health
    watches with 1-2 MB in them held 0.7 GB for as long as their connection stayed open without
    acknowledging (a minute). Such a connection is closed after SETTINGS_ACK_S, what it held with it."""
    from bridge_server.wire.protocol import SETTINGS_ACK_S
    host, port = gated.address.rsplit(":", 1)
    headers = b"".join(_literal(k, v) for k, v in (
        (":method", "POST"), (":scheme", "http"), (":path", "/grpc.health.v1.Health/Watch"),
        (":authority", "a" * 1_000_000), ("content-type", "application/grpc"), ("te", "trailers")))
    chunks = [headers[i:i + 16384] for i in range(0, len(headers), 16384)]
    wire = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + _frame(4, 0, 0, b"") + _frame(1, 0, 1, chunks[0])
    for i, chunk in enumerate(chunks[1:], 2):
        wire += _frame(9, 4 if i == len(chunks) else 0, 1, chunk)
    wire += _frame(0, 1, 1, b"\x00\x00\x00\x00\x00")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(wire)
        sock.settimeout(1.0)
        t0, closed, goaway = time.monotonic(), False, False
        while time.monotonic() - t0 < SETTINGS_ACK_S + 20:
            try:
                more = sock.recv(1 << 16)
            except TimeoutError:
                continue
            except ConnectionResetError:
                closed = True
                break
            if not more:
                closed = True
                break
            goaway = goaway or b"\x07\x00\x00\x00\x00\x00" in more      # a GOAWAY frame's type, flags, stream 0
        took = time.monotonic() - t0
    assert closed, "the connection that never acknowledged stayed open"
    assert took < SETTINGS_ACK_S + 10, took
    assert health(gated) == health_pb2.HealthCheckResponse.SERVING


# ------------------------------------------------------------------------------ the places themselves
def test_places_go_to_each_waiting_host_in_turn_and_never_past_either_bound() -> None:
    """Three places, two a host. Host a asks for five, then b for two: a gets two at once and b one;
    as places come back, b's second and a's next alternate, and a waiter whose call went passes its
    turn on."""
    async def run() -> list[str]:
        places = _Places(ReceiveLimits(at_once=3, per_host=2))
        order: list[str] = []
        held: list[str] = []

        async def ask(host: str) -> None:
            if not places.try_take(host):
                await places.take(host)
            order.append(host)
            held.append(host)
            assert places.taken <= 3 and all(n <= 2 for n in places.by_host.values())

        tasks = [asyncio.create_task(ask(h)) for h in "aaaaa"]
        await asyncio.sleep(0)
        tasks += [asyncio.create_task(ask(h)) for h in "bb"]
        await asyncio.sleep(0)
        assert order == ["a", "a", "b"]
        tasks[2].cancel()                    # a's third waiter went
        for _ in range(4):
            places.give_back(held.pop(0))
            await asyncio.sleep(0)
        await asyncio.gather(*tasks, return_exceptions=True)
        places.give_back(held.pop(0))
        while held:
            places.give_back(held.pop(0))
        assert places.taken == 0 and not places.by_host and not places.waiting
        return order

    order = asyncio.run(run())
    assert order[:3] == ["a", "a", "b"] and sorted(order) == ["a"] * 4 + ["b"] * 2, order
    assert order[3:5] in (["b", "a"], ["a", "b"]), order


def test_callers_without_a_token_hold_half_the_places_and_end_no_read_of_one_with_a_token() -> None:
    """On a server with tokens, header-only health checks (open to anyone) from 4 addresses held
    every place: each authenticated call waited stall_s for one, and an authenticated slow upload
    was ended so that a stranger's check could wait in its place. Callers without a token hold at
    most half the places; a read of one with a token is ended only for another with a token."""
    async def run() -> None:
        places = _Places(ReceiveLimits(at_once=4, per_host=1), anonymous_at_once=2)
        assert places.try_take("10.0.0.1") and places.try_take("10.0.0.2")
        assert not places.try_take("10.0.0.3")                  # the anonymous half is held
        assert places.try_take(IDENTITY + "alice") and places.try_take(IDENTITY + "bob")
        waiting = asyncio.create_task(places.take("10.0.0.3"))
        await asyncio.sleep(0)
        assert not places.others_wait(IDENTITY + "alice")      # a stranger waits: alice's read stays
        assert places.others_wait("10.0.0.1")                   # ... another stranger's may be ended
        carol = asyncio.create_task(places.take(IDENTITY + "carol"))
        await asyncio.sleep(0)
        assert places.others_wait(IDENTITY + "alice")
        places.give_back(IDENTITY + "bob")                      # a place, not an anonymous one: carol's
        await asyncio.sleep(0)
        assert carol.done() and not waiting.done()
        places.give_back("10.0.0.1")
        await asyncio.sleep(0)
        assert waiting.done() and places.anonymous == 2
    asyncio.run(run())


def test_requests_waiting_for_a_place_are_bounded_by_host_and_in_all() -> None:
    """A waiting request holds what its sender sent before a read: 64,000 of one host's (4,000 on each
    of 16 connections) had taken the pool server to 4.7 GB. Past the bounds a request is refused."""
    async def run() -> tuple[str, str, str]:
        places = _Places(ReceiveLimits(at_once=1, per_host=1, waiting_per_host=2, waiting_at_once=3))
        assert places.try_take("a")
        waiters = [asyncio.create_task(places.take(h)) for h in "aab"]
        await asyncio.sleep(0)
        full_host, other_host = places.crowded("a"), places.crowded("b")     # a: 2 of 2; in all: 3 of 3
        waiters[0].cancel()
        await asyncio.sleep(0)
        after = places.crowded("a")
        for w in waiters[1:]:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert places.waiters == 0 and not places.waiting
        return full_host, other_host, after

    full_host, other_host, after = asyncio.run(run())
    assert full_host == "this host has 2" and other_host == "3" and after == "", (full_host, other_host, after)
