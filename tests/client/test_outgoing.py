"""How the Python client's Multiplex requests leave: queued together, sent together."""

from __future__ import annotations

import queue

from bridge_server.client.client import BATCH_BYTES, BATCH_REQUESTS, outgoing
from vllm_bridge.v1 import bridge_pb2 as pb


def _queued(*requests: pb.MuxRequest | None) -> queue.SimpleQueue[pb.MuxRequest | None]:
    q: queue.SimpleQueue[pb.MuxRequest | None] = queue.SimpleQueue()
    for r in requests:
        q.put(r)
    return q


def _start(call_id: int, padding: int = 0) -> pb.MuxRequest:
    call = pb.CallRequest(args=[pb.Value(str="x" * padding)]) if padding else pb.CallRequest()
    return pb.MuxRequest(start=pb.MuxStart(id=call_id, call=call))


def _flatten(sent: list[pb.MuxRequest]) -> list[pb.MuxRequest]:
    return [r for m in sent for r in (m.batch.requests if m.WhichOneof("kind") == "batch" else [m])]


def test_what_is_queued_together_leaves_as_one_batch_in_order() -> None:
    requests = [_start(1), pb.MuxRequest(cancel=7), pb.MuxRequest(credit=pb.MuxCredit(id=1, events=3)), _start(2)]
    sent = list(outgoing(_queued(*requests, None)))
    assert len(sent) == 1 and sent[0].WhichOneof("kind") == "batch"
    assert list(sent[0].batch.requests) == requests


def test_a_request_alone_goes_unwrapped_and_nothing_after_the_end() -> None:
    assert list(outgoing(_queued(_start(1), None, _start(2)))) == [_start(1)]
    assert list(outgoing(_queued(None))) == []


def test_batches_stay_within_their_bounds_and_lose_nothing() -> None:
    big = BATCH_BYTES // 3
    requests = [_start(i, big) for i in range(1, 8)] + [_start(i) for i in range(8, 8 + BATCH_REQUESTS + 5)]
    sent = list(outgoing(_queued(*requests, None)))
    assert _flatten(sent) == requests
    for m in sent:
        parts = m.batch.requests if m.WhichOneof("kind") == "batch" else [m]
        assert len(parts) <= BATCH_REQUESTS
        assert len(parts) == 1 or sum(p.ByteSize() for p in parts) <= BATCH_BYTES
    assert len(sent) >= 4    # 7 requests of a third of the budget each need 3 batches, then the count splits
