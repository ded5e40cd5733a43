"""The streams the Elixir receiver of patches (`VllmBridge.StreamState`) is checked on without a server.

CI has no Elixir, and a live server shows the Elixir side only the patches its requests happen to
make. So the sender (`Patcher`) writes streams that use every op at every depth (vLLM's own
`RequestOutput`s as its output processor changes them, records whose kind and fields change, lists,
tuples, maps and enums changing in place) into `mix_client_example/test/fixtures/patch_streams.bin`,
each item twice, as the `x-bridge-stream-tee` check sends it: the item as it would go (a value or a
patch), then whole; every stream as patch-v1, then again as patch-v2 (rows). `test/stream_state_test.exs` applies the patches and compares with the whole
items. Here: the committed file is what the sender writes now, and the Python receiver agrees with it.

Regenerate with `.venv/bin/python -m tests.tools.test_elixir_patch_fixture`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bridge_server.wire.codec import Encoder
from bridge_server.wire.patch import Patcher
from bridge_server.wire.streamstate import StreamState
from tests.wire.test_patch import Color, Opaque, Pair, Plain, Rec, request_outputs, vllm_records
from vllm_bridge.v1 import bridge_pb2 as pb

FIXTURE = Path(__file__).resolve().parents[2] / "mix_client_example" / "test" / "fixtures" / "patch_streams.bin"


def _refs() -> Any:
    """Refs numbered in the order their objects are first seen, so that the file is the same every time."""
    seen: dict[int, int] = {}
    keep: list[object] = []

    def ref(obj: object) -> pb.Ref:
        if id(obj) not in seen:
            seen[id(obj)] = len(seen)
            keep.append(obj)
        return pb.Ref(id=f"w1.r{seen[id(obj)]}", worker_id="w1", type_name=type(obj).__qualname__)

    return ref


def _small_streams() -> Iterator[Iterator[object]]:
    """Streams of items; the items of one stream are taken as they are when each is yielded."""
    yield from map(iter, _fixed_streams())
    yield _grown()


def _fixed_streams() -> Iterator[list[object]]:
    yield ["a", "ab", "abc", "x", "xy"]                         # a root str: appended, then set
    yield [[1], [1, 2], [1, 2, 3], [1, True]]                   # root ints: appended, then a list
    yield [(1, "a"), (1, "ab"), (1, "ab", None)]                # a tuple: items appended
    yield [{"k": 1}, {"k": 1}, {"k": 2, "j": [1]}]              # maps: set whole
    yield [Rec(a=1), Plain(1, 2), Rec(a=1), 7, "s"]             # the item's kind changes
    yield [Rec(a=a) for a in (1, True, 1.0, -0.0, math.inf, 2**70, Color.RED, Color.BLUE, b"b", None, Pair(1, 2))]
    opaque = Opaque()
    yield [Plain(x=opaque, y=[1]), Plain(x=opaque, y=[1, 2])]  # a ref, sent again whole each time


def _grown() -> Iterator[object]:
    """One object changed in place between items, as vLLM changes its outputs: every op at depth."""
    tokens: list[int] = [1]
    logprobs: list[dict[int, Rec]] = [{1: Rec(a=-0.5)}]
    nested: list[list[str]] = [["q"]]
    item = Plain(x=[tokens, logprobs, nested, ("t",)], y=Rec(a="", b=0))
    yield item
    for i in range(2, 6):
        tokens.append(i)                                     # [0, 0] append_ints
        logprobs.append({i: Rec(a=-0.5 * i)})                # [0, 1] append_items
        nested[0][0] += "r"                                  # [0, 2, 0, 0] append_str
        nested.append([str(i)])                              # [0, 2] append_items
        item.y.a += f" w{i}"                                 # [1, 0] append_str
        item.y.b = i                                         # [1, 1] set
        if i == 4:
            item.x[3] = ("t", i)                             # a tuple replaced
        yield item


def _vllm_streams(encoder_records: dict[type, tuple[str, ...]]) -> Iterator[Iterator[object]]:
    from adapters.async_llm import ASYNC_LLM
    encoder_records[vllm_records()[0]] = next(r.fields for r in ASYNC_LLM.records if r.attr == "RequestOutput")
    for kind in ("cumulative", "delta", "n2-delta", "plain"):
        yield request_outputs(kind)


def build() -> bytes:
    """One MuxReply: for stream n (event id n, from 1), each item as sent, then whole. Every stream
    twice: as patch-v1, then as patch-v2 (with rows)."""
    records: dict[type, tuple[str, ...]] = {Plain: ("x", "y")}
    ref = _refs()
    reply = pb.MuxReply()
    n = 0
    for rows in (False, True):
        # vLLM's records change in place between items: each stream is encoded as it is made
        for items in [*_small_streams(), *_vllm_streams(records)]:
            n += 1
            _tee(reply, n, items, records, ref, rows)
    return reply.SerializeToString(deterministic=True)


def _tee(reply: pb.MuxReply, n: int, items: Iterator[object], records: dict[type, tuple[str, ...]], ref: Any,
         rows: bool) -> None:
    full = Encoder(ref, records=records)
    patcher = Patcher(Encoder(ref, records=records), rows=rows)
    for item in items:
        sent = reply.events.add(id=n)
        patcher.put(item, sent)
        reply.events.add(id=n, value=full.encode(item))


def test_the_committed_fixture_is_what_the_sender_writes_now() -> None:
    assert FIXTURE.read_bytes() == build(), "regenerate: .venv/bin/python -m tests.tools.test_elixir_patch_fixture"


def test_the_python_receiver_rebuilds_every_whole_item_and_every_op_is_there() -> None:
    reply = pb.MuxReply.FromString(FIXTURE.read_bytes())
    states: dict[int, StreamState] = {}
    kinds = set()
    rows = 0
    events = list(reply.events)
    for sent, whole in zip(events[0::2], events[1::2], strict=True):
        assert sent.id == whole.id and whole.WhichOneof("kind") == "value"
        state = states.setdefault(sent.id, StreamState())
        got = state.item(sent).SerializeToString(deterministic=True)
        assert got == whole.value.SerializeToString(deterministic=True)
        kinds |= {(op.WhichOneof("op"), len(op.path) > 1) for op in sent.patch.ops}
        rows += sent.patch.HasField("row")
    every_op = ("set", "append_str", "append_ints", "append_items")
    assert kinds >= {(op, deep) for op in every_op for deep in (False, True)}     # at the root and below it
    assert len(states) >= 20 and rows >= 5


if __name__ == "__main__":
    FIXTURE.write_bytes(build())
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")
