"""The pool server's bound on unread replies (`pool/backlog.py`), on its own: which caller is
refused, which streams are ended, and what still counts after they are. (The router's use of it, with
real callers that never read, is in test_resilience.py.)"""

from __future__ import annotations

import grpc
import pytest

from bridge_server.pool.backlog import Backlog
from bridge_server.wire.errors import BridgeError

MB = 2**20


def ended_into(log: list[tuple[str, BridgeError]], name: str):  # type: ignore[no-untyped-def]
    return lambda err: log.append((name, err))


def test_a_caller_over_its_share_is_refused_while_the_bound_is_passed_and_served_once_it_reads() -> None:
    backlog = Backlog(limit=48 * MB)
    replies = [backlog.open("hoarder", "Call") for _ in range(8)]
    for h in replies:
        backlog.writing(h, 7 * MB, queued=False)      # unary replies gRPC holds until read
    small = backlog.open("reader", "Call")
    backlog.writing(small, 100_000, queued=False)      # one reply crossing the network
    assert backlog.total == 56 * MB + 100_000 and backlog.over()
    with pytest.raises(BridgeError) as err:
        backlog.admit("hoarder", "Call")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.reason == "unread replies"
    assert "max_unread_bytes" in err.value.message and "58,720,256 of them are this caller's" in err.value.message
    backlog.admit("reader", "Call")          # within its share: served
    backlog.admit("stranger", "Call")        # holds nothing: served
    for h in replies[:2]:
        backlog.close(h)                     # read (their RPCs ended)
    assert not backlog.over()
    backlog.admit("hoarder", "Call")
    for h in [*replies[2:], small]:
        backlog.close(h)
    assert backlog.total == 0 and not backlog.by_caller and not backlog.holdings


def test_past_the_bound_the_streams_of_the_caller_holding_the_most_are_ended_and_their_queues_freed() -> None:
    backlog = Backlog(limit=48 * MB)
    ended: list[tuple[str, BridgeError]] = []
    legit = backlog.open("reader", "Multiplex", ended_into(ended, "legit"))
    backlog.add(legit, 2 * MB)
    backlog.writing(legit, 2 * MB)
    hoards = [backlog.open("hoarder", "Multiplex", ended_into(ended, f"hoard{i}")) for i in range(3)]
    backlog.add(hoards[0], 7 * MB)
    backlog.writing(hoards[0], 7 * MB)         # one write gRPC holds: not freed by ending the stream
    backlog.add(hoards[1], 16 * MB)
    assert not ended
    backlog.add(hoards[2], 30 * MB)            # 55 MB in all: past the bound
    assert sorted(name for name, _ in ended) == ["hoard0", "hoard1", "hoard2"]
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.reason == "unread replies" and
               e.message.startswith("Multiplex: ") for _, e in ended)
    assert backlog.total == 9 * MB and backlog.by_caller == {"reader": 2 * MB, "hoarder": 7 * MB}
    backlog.add(hoards[1], 40 * MB)            # an ended stream's late replies are dropped, not counted
    assert backlog.total == 9 * MB
    for h in hoards:
        backlog.unwind(h)                      # their handlers ended; the held write still counts
    assert backlog.by_caller["hoarder"] == 7 * MB
    backlog.close(hoards[0])                   # ... until its RPC ends
    assert backlog.by_caller == {"reader": 2 * MB}
    backlog.written(legit, 2 * MB)
    backlog.close(legit)
    assert backlog.total == 0 and not backlog.holdings and len(ended) == 3


def test_what_gRPC_holds_in_writes_ends_nobody() -> None:
    """Past the bound with nothing queued (every byte in writes gRPC holds), no stream is ended:
    ending one frees nothing, and a caller holding less is never ended for another's."""
    backlog = Backlog(limit=10 * MB)
    ended: list[tuple[str, BridgeError]] = []
    big = backlog.open("hoarder", "Stream", ended_into(ended, "big"))
    backlog.writing(big, 12 * MB, queued=False)
    other = backlog.open("reader", "Multiplex", ended_into(ended, "other"))
    backlog.add(other, MB)
    assert backlog.over() and not ended
    with pytest.raises(BridgeError):
        backlog.admit("hoarder", "Stream")
    backlog.admit("reader", "Stream")


def test_no_bound() -> None:
    backlog = Backlog(limit=0)
    h = backlog.open("c", "Call", lambda err: pytest.fail("ended with no bound"))
    backlog.add(h, 10**12)
    assert not backlog.over()
    backlog.admit("c", "Call")
