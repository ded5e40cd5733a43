"""Replies within the message limit (`Outbox.frames`): a reply over it is split, and a result that
alone is over it ends its call with RESOURCE_EXHAUSTED, not the stream or lane every call shares.
The limit is gRPC's 256 MiB in a real worker; here a small one shows the same mechanism."""

from __future__ import annotations

import asyncio

import grpc

from bridge_server.worker.mux import Outbox
from vllm_bridge.v1 import bridge_pb2 as pb


def test_a_reply_over_the_limit_is_split_and_an_oversized_result_ends_only_its_call() -> None:
    async def run() -> None:
        out = Outbox(max_bytes=4096)
        task = asyncio.get_running_loop().create_task(asyncio.sleep(10))    # the oversized call, still running
        for i in range(1, 9):
            out.add(i).value.str = "x" * 900              # eight results that together exceed one message
        out.add(9).value.bytes = b"y" * 10_000            # one result over the limit by itself
        reply = out.take()
        reply.worker_refs = 5
        frames = out.frames(reply, {9: task})
        replies = [pb.MuxReply.FromString(f) for f in frames]
        assert len(replies) >= 2 and all(len(f) <= 4096 for f in frames)
        assert all(r.worker_refs == 5 for r in replies)
        assert sum(len(f) for f in frames) > 8 * 900 and all(len(f) > 4096 - 1100 for f in frames[:-1])  # filled
        events = {e.id: e for r in replies for e in r.events}
        assert sorted(events) == list(range(1, 10))
        assert all(events[i].value.str == "x" * 900 for i in range(1, 9))
        assert events[9].error.code == grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        assert "over the limit" in events[9].error.message
        await asyncio.sleep(0)
        assert task.cancelled()                           # the call ends; nothing more of it is sent
        out.add(9).value.str = "late"
        assert not out.reply.events
        small = out.frames(pb.MuxReply(events=[pb.MuxEvent(id=1, value=pb.Value(int=1))]), {})
        assert len(small) == 1                            # the common case: one serialization, nothing more

    asyncio.run(run())
