"""The pool server's bound on unread replies (`pool/backlog.py`), on its own: which results fit,
which callers are refused, which streams are ended, and what still counts after they are. (The
router's use of it, with real callers that never read, is in test_resilience.py.)"""

from __future__ import annotations

import time
from collections.abc import Callable

import grpc
import pytest

from bridge_server.pool.backlog import Backlog, Holding
from bridge_server.wire.protocol import host_of
from bridge_server.wire.errors import BridgeError

MB = 2**20


def ended_into(log: list[tuple[str, BridgeError]], name: str) -> Callable[[BridgeError], None]:
    return lambda err: log.append((name, err))


def unread_for(h: Holding, seconds: float) -> None:
    """As if the write in flight had waited that long for its caller."""
    h.blocked_since = time.monotonic() - seconds


def reply(backlog: Backlog, caller: str, size: int) -> Holding:
    """A unary reply handed to gRPC, as the router's Call does."""
    h = backlog.open(caller, "Call")
    refused = backlog.take(h, size, "Call")
    if refused is not None:
        backlog.close(h)
        raise refused
    backlog.writing(h, size)
    return h


def test_results_fit_within_the_limit_and_past_it_within_their_caller_s_share_whatever_the_connections() -> None:
    backlog = Backlog(limit=48 * MB)
    held = [reply(backlog, "hoarder", 7 * MB) for _ in range(6)]     # 42 MB: within the limit
    with pytest.raises(BridgeError) as err:
        reply(backlog, "hoarder", 7 * MB)                              # past it, and past its share (all of it)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "unread replies"
    assert "7,340,032 bytes does not fit" in err.value.message and "max_unread_bytes" in err.value.message
    reader = reply(backlog, "reader", 7 * MB)                          # past the limit, within its share (24 MB)
    refused = 0
    for i in range(40):                 # a stranger's connections, each its own caller: the sum stays bounded
        try:
            held.append(reply(backlog, f"connection {i}", 7 * MB))
        except BridgeError:
            refused += 1
    assert refused > 30 and backlog.total <= 2 * backlog.limit
    assert backlog.refused == refused + 1
    with pytest.raises(BridgeError) as err:
        backlog.admit("hoarder", "Call")                               # holds more than its share: no new call
    assert "it gets no new call until it reads them" in err.value.message
    backlog.admit("a newcomer", "Call")
    for h in held:
        backlog.close(h)                                               # read (their RPCs ended)
    assert not backlog.over()
    backlog.admit("hoarder", "Call")
    backlog.close(reader)
    assert backlog.total == 0 and not backlog.by_caller and not backlog.holdings


def test_streams_left_unread_are_ended_first_and_a_stream_that_is_read_never_is() -> None:
    backlog = Backlog(limit=48 * MB)
    ended: list[tuple[str, BridgeError]] = []
    legit = backlog.open("reader", "Multiplex", ended_into(ended, "legit"))
    assert backlog.take(legit, 20 * MB, "Multiplex: call 1") is None     # a burst it reads as it comes
    backlog.writing(legit, 2 * MB)
    hoards = [backlog.open("hoarder", "Multiplex", ended_into(ended, f"hoard{i}")) for i in range(3)]
    for h, size in zip(hoards[:2], (7 * MB, 16 * MB)):
        assert backlog.take(h, size, "Multiplex: call 1") is None
        backlog.writing(h, MB)                 # its first write, which the caller leaves unread
        unread_for(h, 1.0)
    assert not ended and backlog.total == 43 * MB
    assert backlog.take(hoards[2], 10 * MB, "Multiplex: call 1") is None   # the unread streams go first
    assert sorted(name for name, _ in ended) == ["hoard0", "hoard1"]
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.reason == "unread replies" and
               e.message.startswith("Multiplex: ") for _, e in ended)
    assert backlog.total == 32 * MB and backlog.by_caller == {"reader": 20 * MB, "hoarder": 12 * MB}
    backlog.add(hoards[1], 40 * MB)            # an ended stream's late replies are dropped, not counted
    assert backlog.total == 32 * MB
    refused = backlog.take(legit, 20 * MB, "Multiplex: call 2")    # past the bound, past its share
    assert refused is not None and refused.reason == "unread replies" and refused.message.startswith(
        "Multiplex: call 2: its result of 20,971,520 bytes does not fit")
    assert len(ended) == 2                     # ... but its stream, being read, goes on
    for h in hoards:
        backlog.unwind(h)                      # their handlers ended; the held writes still count
    assert backlog.by_caller["hoarder"] == 2 * MB
    for h in hoards:
        backlog.close(h)                       # ... until their RPCs end
    assert backlog.by_caller == {"reader": 20 * MB}
    backlog.written(legit, 2 * MB)
    backlog.close(legit)
    assert backlog.total == 0 and not backlog.holdings and len(ended) == 2


def test_what_gRPC_holds_in_writes_still_counts_and_ends_nobody_else() -> None:
    """Past the bound with the hoarder's bytes all in a write gRPC holds: its unread stream is
    ended (no more of its results come), which frees nothing yet, so the bytes still count, its
    new calls are refused, and a caller whose stream is read goes on within its share."""
    backlog = Backlog(limit=10 * MB)
    ended: list[tuple[str, BridgeError]] = []
    big = backlog.open("hoarder", "Stream", ended_into(ended, "big"))
    assert backlog.take(big, 9 * MB, "Stream") is None
    backlog.writing(big, 9 * MB)
    unread_for(big, 1.0)
    other = backlog.open("reader", "Multiplex", ended_into(ended, "other"))
    assert backlog.take(other, 2 * MB, "Multiplex: call 1") is None
    assert [name for name, _ in ended] == ["big"]
    assert backlog.over() and backlog.by_caller == {"hoarder": 9 * MB, "reader": 2 * MB}
    assert backlog.take(other, MB, "Multiplex: call 2") is None
    assert len(ended) == 1
    with pytest.raises(BridgeError):
        backlog.admit("hoarder", "Stream")
    backlog.admit("reader", "Stream")


def test_no_bound() -> None:
    backlog = Backlog(limit=0)
    h = backlog.open("c", "Call", lambda err: pytest.fail("ended with no bound"))
    assert backlog.take(h, 10**12, "Call") is None
    backlog.writing(h, 10**12)
    unread_for(h, 10.0)
    assert backlog.take(h, 10**12, "Call") is None
    assert not backlog.over()
    backlog.admit("c", "Call")


def test_a_stranger_s_connections_from_one_host_hold_one_host_s_share_and_other_hosts_keep_theirs() -> None:
    """Each connection had its own share, so a stranger's connections from one host together held
    twice the limit, and every other caller's large result was refused for as long as they stayed
    open (gRPC keeps an unread reply until its caller reads or goes)."""
    backlog = Backlog(limit=48 * MB)
    refused = 0
    for i in range(40):
        try:
            reply(backlog, f"ipv4:10.0.0.66:{40000 + i} multiplex {i}" if i % 2 else f"ipv4:10.0.0.66:{40000 + i}",
                  7 * MB)
        except BridgeError:
            refused += 1
    assert refused == 34 and backlog.total == 42 * MB         # the limit, no more: the host's whole share
    # Another host: half of the limit (a second host), then a third host: a third.
    for other, fit in (("ipv6:[2001:db8::7]:5000", 3), ("ipv4:10.0.0.67:5000", 2)):
        for _ in range(fit):
            reply(backlog, other, 7 * MB)
        with pytest.raises(BridgeError):
            reply(backlog, other, 7 * MB)
    assert backlog.total <= 2 * backlog.limit
    assert backlog.by_host == {"ipv4:10.0.0.66": 42 * MB, "ipv6:[2001:db8::]/64": 21 * MB, "ipv4:10.0.0.67": 14 * MB}
    assert backlog.callers_of["ipv4:10.0.0.66"] == 6


def test_the_host_of_a_caller_is_its_peer_address_less_the_port() -> None:
    assert host_of("ipv4:10.0.0.1:5000") == host_of("ipv4:10.0.0.1:6000 multiplex 3") == "ipv4:10.0.0.1"
    # one machine, one subscriber: a stranger gave each of 2,500 connections an address of its own
    assert host_of("ipv4:127.0.0.1:5000") == host_of("ipv4:127.1.2.3:5000") == host_of("ipv6:[::1]:5000") == \
        host_of("ipv6:[::ffff:127.0.0.1]:5000") == "loopback"
    assert host_of("ipv6:[2001:db8::7]:5000") == host_of("ipv6:[2001:db8::1:2:3:4]:6000") == "ipv6:[2001:db8::]/64"
    assert host_of("ipv6:[2001:db8:0:1::7]:5000") != host_of("ipv6:[2001:db8::7]:5000")
    assert host_of("ipv6:[::ffff:10.0.0.1]:5000") == "ipv4:10.0.0.1"
    assert host_of("unix:/tmp/x.sock") == "unix:/tmp/x.sock" and host_of("alice") == "alice"


def test_a_connection_beside_one_that_hoards_on_the_same_host_gets_its_own_share() -> None:
    backlog = Backlog(limit=48 * MB)
    for _ in range(6):
        reply(backlog, "ipv4:10.0.0.5:4000", 7 * MB)        # 42 MB, all of one connection
    with pytest.raises(BridgeError):
        reply(backlog, "ipv4:10.0.0.5:4000", 7 * MB)        # past the limit and past its share
    for _ in range(3):                                      # the host's share over 2 connections: 24 MB
        reply(backlog, "ipv4:10.0.0.5:4001", 7 * MB)
    with pytest.raises(BridgeError):
        reply(backlog, "ipv4:10.0.0.5:4001", 7 * MB)
    assert backlog.by_host == {"ipv4:10.0.0.5": 63 * MB}    # within 1.5 host shares (72 MB)


def test_large_requests_count_with_replies_and_are_refused_past_their_caller_s_share() -> None:
    """gRPC reads a request whole before the router sees it, and the router holds it until its call
    ends (waiting for a slot, then for its turn in the worker's lane): ninety-six 60 MiB calls took
    the pool server to 8.4 GB. They count with replies, under the same bound and shares."""
    backlog = Backlog(limit=48 * MB)

    def request(caller: str, size: int) -> Holding:
        h = backlog.open(caller, "Call")
        refused = backlog.take(h, size, "Call", request=True)
        if refused is not None:
            backlog.close(h)
            raise refused
        return h

    held = [request(f"ipv4:10.0.0.1:{5000 + i}", 7 * MB) for i in range(6)]      # 42 MB: within the limit
    refused: list[BridgeError] = []
    for i in range(40):                      # the same host's other connections: its share, then refused
        try:
            held.append(request(f"ipv4:10.0.0.1:{6000 + i}", 7 * MB))
        except BridgeError as err:
            refused.append(err)
    assert len(refused) > 30 and backlog.total <= 2 * backlog.limit
    err = refused[0]
    assert err.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.reason == "large requests", err
    assert "its request of 7,340,032 bytes does not fit" in err.message and "max_unread_bytes" in err.message
    reader = reply(backlog, "ipv4:10.0.0.2:5000", 7 * MB)       # another host still gets its share
    for h in [*held, reader]:
        backlog.close(h)
    assert backlog.total == 0 and not backlog.by_host
