"""Stream items as patches (STREAM_ENCODING_PATCH_V1): after every item, the receiver's state is
exactly the Value the full encoding sends for that item, whatever the sender's objects did in
between (grew in place, shrank, changed type, kept their identity while changing their contents)."""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from bridge_server.wire.codec import CodecError, Encoder
from bridge_server.wire.decoder import Decoder
from bridge_server.wire.options import (
    STREAM_FULL,
    STREAM_PATCH_V1,
    STREAM_PATCH_V2,
    RuntimeOptions,
    parse_metadata,
    to_metadata,
)
from bridge_server.wire.patch import Patcher
from bridge_server.wire.streamstate import DecodedStream, StreamState
from vllm_bridge.v1 import bridge_pb2 as pb


def by_identity(obj: object) -> pb.Ref:
    """Refs named after the object, so that both encodings of one object give the same ref."""
    return pb.Ref(id=f"w1.{id(obj)}", worker_id="w1", type_name=type(obj).__qualname__)


class Plain:
    """A plain class that an adapter declares to be a record (as vLLM's RequestOutput is)."""

    def __init__(self, x: object, y: object) -> None:
        self.x, self.y = x, y


@dataclasses.dataclass
class Rec:
    a: Any
    b: Any = None
    c: Any = dataclasses.field(default=None, init=False)   # left out while never set


class Struct(msgspec.Struct):
    p: Any
    q: Any = msgspec.UNSET        # left out while UNSET


class Pair(NamedTuple):
    left: Any
    right: Any


class Color(enum.Enum):
    RED = 1
    BLUE = "blue"


class Opaque:
    """Goes as a ref."""


RECORDS = {Plain: ("x", "y")}


def encoders(**options: Any) -> tuple[Encoder, Patcher]:
    return (Encoder(by_identity, records=RECORDS, **options),
            Patcher(Encoder(by_identity, records=RECORDS, **options)))


def check_stream(items: Iterator[object], stream_item: type = pb.MuxEvent, **options: Any) -> list[pb.MuxEvent]:
    """Sends each item (taken as the sender's objects are at that moment) both ways and checks that
    the patched state equals the full Value, byte for byte; returns what was sent. A stream's own
    full encoder (with a memo, as a worker's is) must agree with a fresh encoding too. Each item is
    patched twice, without rows (patch-v1: what is returned) and with them (patch-v2, in
    `check_stream.rows`), and both are received."""
    full, patcher = encoders(**options)
    with_rows = Patcher(Encoder(by_identity, records=RECORDS, **options), rows=True)
    streamed = Encoder(by_identity, records=RECORDS, memo={}, **options)
    receivers = [(patcher, StreamState(), DecodedStream(CLIENT_DECODER), []),
                 (with_rows, StreamState(), DecodedStream(CLIENT_DECODER), [])]
    seen = []
    for i, item in enumerate(items):
        value = full.encode(item)
        expected = value.SerializeToString(deterministic=True)
        assert streamed.encode(item).SerializeToString(deterministic=True) == expected, f"item {i}, whole"
        for sender, state, decoded, sent in receivers:
            msg = stream_item()
            sender.put(item, msg)
            msg = stream_item.FromString(msg.SerializeToString())    # over the wire
            got = state.item(msg).SerializeToString(deterministic=True)
            assert got == expected, f"item {i} (rows: {sender.rows}): {msg}"
            seen.append((decoded.item(msg), value))
            assert_same(seen[-1][0], CLIENT_DECODER.decode(value), f"item {i}, decoded")
            sent.append(msg)
    for i, (item_decoded, value) in enumerate(seen):    # no later item changed an earlier one
        assert_same(item_decoded, CLIENT_DECODER.decode(value), f"item {i // 2}, decoded, at the end")
    check_stream.rows = receivers[1][3]      # type: ignore[attr-defined]
    return receivers[0][3]


CLIENT_DECODER = Decoder(resolve_ref=lambda ref: ref, resolve_type=lambda name: None,
                         unknown_enum=lambda msg: (msg.type_name, msg.name))


def assert_same(got: Any, expected: Any, where: str) -> None:
    """Equal as decoded values: of the same types all the way down, NaNs and tensors included."""
    assert type(got) is type(expected), f"{where}: {type(got)} vs {type(expected)}"
    if isinstance(got, torch.Tensor):
        assert got.dtype == expected.dtype and torch.equal(got, expected), where
    elif isinstance(got, float):
        assert got == expected and math.copysign(1, got) == math.copysign(1, expected) or (
            math.isnan(got) and math.isnan(expected)), f"{where}: {got} vs {expected}"
    elif isinstance(got, dict):
        assert list(got) == list(expected), f"{where}: keys {list(got)} vs {list(expected)}"
        for k in got:
            assert_same(got[k], expected[k], f"{where}.{k}")
    elif isinstance(got, (list, tuple)):
        assert len(got) == len(expected), f"{where}: {len(got)} vs {len(expected)} items"
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, f"{where}: {got!r} vs {expected!r}"


def ops(msg: Any) -> list[tuple[list[int], str]]:
    return [(list(op.path), op.WhichOneof("op")) for op in msg.patch.ops]


# --- what goes on the wire ------------------------------------------------------------------------

def test_the_first_item_is_whole_and_later_ones_carry_only_what_changed() -> None:
    tokens: list[int] = [1]
    stats = Rec(a=0, b=0.5)

    def items() -> Iterator[Plain]:
        for i in range(2, 6):
            tokens.append(i)                   # the same list, grown in place (vLLM's CUMULATIVE)
            stats.a += 1                       # the same stats object, changed in place
            yield Plain(x=["constant", "prefix" + "." * i, tokens], y=stats)

    sent = check_stream(items())
    assert sent[0].WhichOneof("kind") == "value"
    assert all(m.WhichOneof("kind") == "patch" for m in sent[1:])
    assert ops(sent[1]) == [([0, 1], "append_str"), ([0, 2], "append_ints"), ([1, 0], "set")]
    assert list(sent[1].patch.ops[1].append_ints.values) == [3]


def test_an_unchanged_item_is_an_empty_patch_and_a_stream_item_says_which_it_is() -> None:
    sent = check_stream(iter([Rec(a="x"), Rec(a="x"), Rec(a="x")]), stream_item=pb.StreamItem)
    assert sent[0].HasField("value") and not sent[0].HasField("patch")
    assert all(m.HasField("patch") and not m.HasField("value") and not m.patch.ops for m in sent[1:])


def test_in_place_changes_that_keep_the_objects_identity_are_seen() -> None:
    ids = [5, 6, 7]
    logprobs: list[dict[int, Rec]] = [{5: Rec(a=-0.5)}]
    item = Plain(x=ids, y=logprobs)

    def items() -> Iterator[Plain]:
        yield item
        ids[1] = 60                            # an old item changed: not an append
        yield item
        ids[1] = True                          # equal to 1 would be, but a bool: a list of Values now
        yield item
        ids[:] = [1, 2]                        # shrunk
        yield item
        logprobs[0][5].a = -0.25               # deep inside an earlier list item
        yield item
        logprobs.append({6: Rec(a=-1.0)})      # appended
        yield item
        logprobs[1][7] = Rec(a=-2.0)           # a map grew
        yield item

    sent = check_stream(items())
    assert ops(sent[1]) == [([0], "set")]
    assert ops(sent[5]) == [([1], "append_items")]


def test_strings_grow_by_appends_and_anything_else_is_set() -> None:
    sent = check_stream(iter([Rec(a="ab"), Rec(a="abcd"), Rec(a="abXd"), Rec(a=""), Rec(a=b"ab"), Rec(a="ab")]))
    assert [ops(m) for m in sent[1:]] == [[([0], "append_str")], [([0], "set")], [([0], "set")], [([0], "set")],
                                          [([0], "set")]]


@pytest.mark.parametrize("pair", [(1, True), (1, 1.0), (0.0, -0.0), (float("nan"), float("nan")), ("a", Color.RED),
                                  (Color.RED, Color.BLUE), ((1,), [1]), ([1], [1, 2**64]), ([], [1]), ([1], []),
                                  (2**70, 2**70 + 1), ({1: 2}, {1: 2.0}), (Pair(1, 2), (1, 2)), ({1}, {1})])
def test_values_that_compare_equal_but_encode_differently_are_sent_again(pair: tuple[object, object]) -> None:
    a, b = pair
    check_stream(iter([Rec(a=a), Rec(a=b), Rec(a=a), Rec(a=a)]))


def test_records_whose_fields_come_and_go_are_sent_with_the_fields_they_have() -> None:
    rec, struct, plain = Rec(a=1), Struct(p=1), Plain(1, 2)

    def items() -> Iterator[list[object]]:
        yield [rec, struct, plain]
        rec.c = "set now"                      # an init=False field appears
        struct.q = [1]                         # a msgspec field stops being UNSET
        del plain.y                            # an adapter record's attribute goes away
        yield [rec, struct, plain]
        struct.q = msgspec.UNSET
        plain.y = 3
        yield [rec, struct, plain]
        yield [rec, struct, plain]
        rec.a = msgspec.UNSET                  # a dataclass's field, left out while UNSET
        yield [rec, struct, plain, [1, msgspec.UNSET]]
        rec.a = [2]
        yield [rec, struct, plain, [1, msgspec.UNSET]]

    check_stream(items())


def test_a_place_patched_again_after_something_above_it_was_replaced_is_found_anew() -> None:
    """The receiver remembers where its ops landed; a `set` above such a place replaces what is
    below it, and the next op there must land in the new value, not in what was replaced."""
    sent = check_stream(iter([Rec(a=["x"]), Rec(a=["xy"]), Rec(a=("xy",)), Rec(a=("xyz",)), Rec(a=("xyzw",)),
                              Rec(a=[["q"]]), Rec(a=[["qr"]]), Rec(a=[["qr", "s"]]), Rec(a=[["qr", "st"]])]))
    assert [ops(m) for m in sent[1:5]] == [[([0, 0], "append_str")], [([0], "set")], [([0, 0], "append_str")],
                                           [([0, 0], "append_str")]]


def test_fields_declared_constant_are_trusted_while_they_stay_the_same_object_as_the_full_encoding_does() -> None:
    """An adapter declares the fields of a record that stay the same object through a stream (a
    request's prompt token ids): the full encoding of a stream sends their first encoding again
    while they are that object, and so do patches, without comparing a long prompt every item.
    Another object in their place, even an equal one, is sent whole, as the full encoding encodes it
    anew."""
    prompt = list(range(1000))
    items = [Plain(x=prompt, y=1), Plain(x=prompt, y=2), Plain(x=list(prompt), y=3), Plain(x=[7], y=4)]
    whole = Encoder(by_identity, records=RECORDS, constant_fields={Plain: frozenset({"x"})}, memo={})
    patcher = Patcher(Encoder(by_identity, records=RECORDS, constant_fields={Plain: frozenset({"x"})}))
    state = StreamState()
    sent = []
    for item in items:
        msg = pb.MuxEvent()
        patcher.put(item, msg)
        sent.append(msg)
        assert state.item(msg).SerializeToString(deterministic=True) == \
            whole.encode(item).SerializeToString(deterministic=True)
    assert [ops(m) for m in sent[1:]] == [[([1], "set")], [([0], "set"), ([1], "set")],
                                          [([0], "set"), ([1], "set")]]


def test_a_field_declared_constant_is_not_shadowed() -> None:
    """A request's prompt logprobs (a dict of records per prompt token) are declared constant: the
    first item encodes them, and nothing reads them again to keep a copy that is never compared
    (for a 200-token prompt with 5 logprobs that copy cost the first item 14 ms)."""
    held = [Counted({i: -0.5 * i}) for i in range(50)]
    records = {**RECORDS, Counted: ("v",)}
    options: dict[str, Any] = {"records": records, "constant_fields": {Plain: frozenset({"x"})}}
    patcher = Patcher(Encoder(by_identity, **options))
    Counted.reads = 0
    Encoder(by_identity, **options).encode(Plain(x=held, y=0))
    encoding = Counted.reads
    Counted.reads = 0
    patcher.put(Plain(x=held, y=0), pb.MuxEvent())
    assert Counted.reads == encoding
    Counted.reads = 0
    msg = pb.MuxEvent()
    patcher.put(Plain(x=held, y=1), msg)
    assert Counted.reads == 0 and ops(msg) == [([1], "set")]



class Counted:
    """A record that counts how often its fields are read: what a sender looks at."""

    reads = 0

    def __init__(self, v: object) -> None:
        self._v = v

    @property
    def v(self) -> object:
        Counted.reads += 1
        return self._v


def grown_stream(n: int, **options: Any) -> tuple[int, list[pb.MuxEvent]]:
    """A record whose field `x` is one list grown by an item per stream item (a generation's
    logprobs), streamed as patches: the reads of the list's items, and what was sent."""
    held: list[Any] = []
    ints: list[int] = []

    def items() -> Iterator[Plain]:
        for i in range(n):
            held.append(Counted({i: -0.5 * i}))
            ints.append(i)
            yield Plain(x=held, y=ints)

    records = {**RECORDS, Counted: ("v",)}
    full = Encoder(by_identity, records=records, **options)
    patcher = Patcher(Encoder(by_identity, records=records, **options))
    whole = Encoder(by_identity, records=records, memo={}, **options)     # a stream's, sent whole
    decoded_records = []     # the records a client's decoder built: one resolve_type each
    decoded = DecodedStream(Decoder(resolve_ref=lambda ref: ref,
                                    resolve_type=lambda name: decoded_records.append(name)))
    state, sent, reads = StreamState(), [], {"patch": 0, "whole": 0}
    for item in items():
        expected = full.encode(item).SerializeToString(deterministic=True)
        msg = pb.MuxEvent()
        Counted.reads = 0
        patcher.put(item, msg)
        reads["patch"] += Counted.reads
        Counted.reads = 0
        assert whole.encode(item).SerializeToString(deterministic=True) == expected
        reads["whole"] += Counted.reads
        assert state.item(msg).SerializeToString(deterministic=True) == expected
        decoded.item(msg)
        sent.append(msg)
    reads["decoded"] = len(decoded_records)
    return reads, sent


def test_fields_declared_growing_cost_what_they_grew_by_not_their_length() -> None:
    """A long generation's logprobs: undeclared, every item compares (or, sent whole, encodes) all
    the list's items again, a stream quadratic in its length; declared growing, only the new one is
    looked at: compared by patches, encoded onto a copy of the last encoding by whole values."""
    n = 120
    undeclared, _ = grown_stream(n)
    assert undeclared["patch"] >= n * (n - 1) // 2 and undeclared["whole"] >= n * (n - 1) // 2
    grown, sent = grown_stream(n, growing_fields={Plain: frozenset({"x", "y"})})
    assert grown["whole"] <= 4 * n
    # each new item is read to encode it, as the whole encoding reads it, and not again to shadow it
    # (nothing compares it while the list stays)
    assert grown["patch"] <= grown["whole"] + 2
    assert grown["decoded"] == n + 1     # a client decodes each new record once, and the first root
    assert all(ops(m) == [([0], "append_items"), ([1], "append_ints")] for m in sent[1:])


@pytest.mark.parametrize("change", ["replaced", "shrunk", "no longer ints", "emptied"])
def test_a_growing_field_that_does_not_grow_is_compared_or_sent_whole(change: str) -> None:
    """A declaration trusts a list's old items only while the field is still the very list the last
    item held and has not shrunk; anything else is compared as any list is."""
    grown: list[Any] = [1, 2]
    items: list[Plain] = [Plain(x=grown, y=0)]
    grown.append(3)
    items.append(Plain(x=grown, y=1))

    def taken() -> Iterator[Plain]:
        for i, item in enumerate(items):
            yield item
            if i == 1:
                if change == "replaced":
                    items.append(Plain(x=[1, 5, 3, 4], y=2))
                elif change == "shrunk":
                    del grown[1:]
                    items.append(Plain(x=grown, y=2))
                elif change == "no longer ints":
                    grown.append("four")
                    items.append(Plain(x=grown, y=2))
                else:
                    grown.clear()
                    items.append(Plain(x=grown, y=2))
                grown.append(9) if change != "replaced" else None
                items.append(Plain(x=items[-1].x, y=3))

    check_stream(taken(), growing_fields={Plain: frozenset({"x"})})

@pytest.mark.parametrize("then", ["an old item replaced", "an old item changed in the copy", "the same items"])
def test_a_growing_list_of_records_taken_over_by_another_list_is_sent_as_it_now_is(then: str) -> None:
    """What is appended to a growing list is encoded but not shadowed while the field is still that
    list. Once another list takes its place, the receiver must still end up with exactly that list:
    the items it cannot compare are sent again."""
    grown: list[Any] = [Rec(a=0, b=[0])]

    def items() -> Iterator[Plain]:
        yield Plain(x=grown, y=0)
        for i in range(1, 4):
            grown.append(Rec(a=i, b={"k": [i, "v"]}))
            yield Plain(x=grown, y=i)
        other = list(grown)
        if then == "an old item replaced":
            other[2] = Rec(a=20, b={"k": [20, "v"]})
        elif then == "an old item changed in the copy":
            other[1] = dataclasses.replace(other[1], b={"k": [10, "w"]})
        yield Plain(x=other, y=9)
        other.append(Rec(a=5, b=(5,)))
        yield Plain(x=other, y=10)

    check_stream(items(), growing_fields={Plain: frozenset({"x"})})


def reads_both_ways(items: Iterator[object], counted: Callable[[int], bool]) -> dict[str, int]:
    """Each item encoded whole and patched (the patch received and checked against the whole value),
    with the reads of `Counted` records each way, for the items `counted` (by position) picks."""
    records = {**RECORDS, Counted: ("v",)}
    whole = Encoder(by_identity, records=records)
    patcher = Patcher(Encoder(by_identity, records=records))
    state, reads = StreamState(), {"whole": 0, "patch": 0}
    for i, item in enumerate(items):
        Counted.reads = 0
        expected = whole.encode(item).SerializeToString(deterministic=True)
        reads["whole"] += Counted.reads if counted(i) else 0
        Counted.reads = 0
        msg = pb.MuxEvent()
        patcher.put(item, msg)
        reads["patch"] += Counted.reads if counted(i) else 0
        assert state.item(msg).SerializeToString(deterministic=True) == expected, i
    return reads


def test_a_map_different_at_every_item_is_sent_whole_and_no_longer_shadowed() -> None:
    """A DELTA generation's logprob dict is new at every token: once a map has been different at two
    items in a row, it is sent whole without a shadow that would only be found different again, so
    the sender reads it as often as the whole encoding does. Whatever comes after (the same map
    again, something else) still arrives exactly."""
    n = 40

    def items(record: Callable[[float], object] = Counted) -> Iterator[Plain]:
        for i in range(n):
            yield Plain(x=[{i: record(-0.5 * i), i + 1: record(0.5)}], y=i)
        same = {7: record(1.0)}
        for i in range(3):
            yield Plain(x=[same], y=n + i)
        yield Plain(x=[None], y=0)
        yield Plain(x=[{1: 2}], y=0)

    reads = reads_both_ways(items(), lambda i: i < n)
    assert reads["patch"] <= reads["whole"] + 12, reads     # the first two items' shadows, and no more
    check_stream(items(lambda v: Rec(a=v)))      # both encodings, decoded by every receiver


def test_a_list_sent_whole_at_every_item_is_no_longer_shadowed() -> None:
    """Under load vLLM merges a DELTA request's waiting outputs: its logprob list is one dict, then
    three, then one... and whenever it is shorter than the last it is sent whole. Once that has
    happened at two items in a row, the list is sent whole without a shadow; what arrives is still
    exactly the whole encoding, whatever comes after."""
    lengths = [3, 1, 3, 1, 2, 1] * 6

    def items(record: Callable[[float], object] = Counted) -> Iterator[Plain]:
        for i, k in enumerate(lengths):
            yield Plain(x=[{i: record(-0.5 * j)} for j in range(k)], y=i)
        yield Plain(x=[{1: record(1.0)}, {2: record(2.0)}], y=0)
        yield Plain(x=(), y=0)

    reads = reads_both_ways(items(), lambda i: i >= 4)
    assert reads["patch"] == reads["whole"], reads      # from the fifth item on, encoded and nothing more
    check_stream(items(lambda v: Rec(a=v)))


def test_refs_tensors_and_sets_are_sent_whole_every_time() -> None:
    opaque, tensor, members = Opaque(), torch.arange(4), {1, 2}
    sent = check_stream(iter([Plain(x=opaque, y=[tensor, members])] * 3))
    assert all(ops(m) == [([0], "set"), ([1, 0], "set"), ([1, 1], "set")] for m in sent[1:])


def test_cycles_and_structures_past_the_depth_limit_go_as_refs_as_they_would_whole() -> None:
    loop: list[object] = [1]
    loop.append(loop)
    deep: list[object] = [0]
    for _ in range(6):
        deep = [deep]
    check_stream(iter([Rec(a=loop, b=deep), Rec(a=loop, b=deep), Rec(a=[loop], b=[deep])]), max_depth=4)


@pytest.mark.parametrize("items", [[1, 2, 2], ["a", "ab", "abc"], [[1], [1, 2], [1, 2]], [(1, "a"), (1, "ab")],
                                   [{"k": 1}, {"k": 1}], [Opaque(), Opaque()], [Rec(a=1), Plain(1, 2), Rec(a=1)]])
def test_any_kind_of_stream_works(items: list[object]) -> None:
    check_stream(iter(items))


# --- any sequence of changes ----------------------------------------------------------------------

leaves = st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.sampled_from([2**63 - 1, 2**63, -(2**70)]),
                   st.sampled_from([0.0, -0.0, 1.0, math.inf, math.nan]), st.text(max_size=3), st.binary(max_size=2),
                   st.sampled_from([Color.RED, Color.BLUE]))
trees = st.recursive(
    leaves,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(st.integers(-2, 2), min_size=1, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.dictionaries(st.text(max_size=2), inner, max_size=3),
        st.builds(Rec, inner, inner),
        st.builds(Plain, inner, inner),
        st.builds(Pair, inner, inner),
    ),
    max_leaves=12,
)


def places(tree: object) -> list[tuple[Any, Any]]:
    """Every (container, key) in the tree whose value can be changed in place."""
    out: list[tuple[Any, Any]] = []
    seen: set[int] = set()

    def walk(x: object) -> None:
        if id(x) in seen:
            return
        seen.add(id(x))
        if isinstance(x, list):
            out.extend((x, i) for i in range(len(x)))
            out.append((x, None))           # the list itself: grow or shrink it
        elif isinstance(x, dict):
            out.extend((x, k) for k in x)
        elif isinstance(x, (Rec, Plain)):
            out.extend((x, f.name) for f in dataclasses.fields(x)) if isinstance(x, Rec) else \
                out.extend((x, n) for n in ("x", "y"))
        children = x if isinstance(x, (list, tuple)) else x.values() if isinstance(x, dict) else \
            vars(x).values() if isinstance(x, (Rec, Plain)) else ()
        for c in children:
            walk(c)

    walk(tree)
    return out


def change(data: st.DataObject, tree: object) -> None:
    spots = places(tree)
    if not spots:
        return
    holder, key = data.draw(st.sampled_from(spots))
    if key is None:
        how = data.draw(st.sampled_from(["append", "extend", "pop", "clear"]))
        if how == "append":
            holder.append(data.draw(trees))
        elif how == "extend":
            holder.extend(data.draw(st.lists(st.integers(-2, 2), max_size=2)))
        elif holder:
            holder.pop() if how == "pop" else holder.clear()
        return
    current = holder[key] if isinstance(holder, (list, dict)) else getattr(holder, key)
    new = data.draw(st.one_of(trees, st.just(current + "z") if isinstance(current, str) else trees))
    if isinstance(holder, (list, dict)):
        holder[key] = new
    else:
        setattr(holder, key, new)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_sequence_of_in_place_changes_patches_to_the_full_encoding(data: st.DataObject) -> None:
    root = Rec(a=data.draw(trees), b=[data.draw(trees)])

    def items() -> Iterator[object]:
        yield root
        for _ in range(data.draw(st.integers(1, 6))):
            for _ in range(data.draw(st.integers(0, 3))):
                change(data, root)
            yield root

    check_stream(items(), max_depth=6)


def random_op(data: st.DataObject, state: pb.Value) -> pb.PatchOp:
    """An op as any server might send it: mostly one that fits (a path into the state, an op for
    its target's kind), sometimes a path past the end or into what has no parts, or any op."""
    fits = data.draw(st.integers(0, 9)) > 0
    path: list[int] = []
    node = state

    def parts(node: pb.Value) -> Any:
        kind = node.WhichOneof("kind")
        return node.record.fields if kind == "record" else getattr(node, kind).items \
            if kind in ("list", "tuple") else []

    while data.draw(st.integers(0, 3)) > 0 and (parts(node) or not fits):
        items = parts(node)
        step = data.draw(st.integers(0, len(items) - 1 if fits else len(items)))
        path.append(step)
        if step >= len(items):
            break
        node = items[step].value if node.WhichOneof("kind") == "record" else items[step]
    encode = Encoder(by_identity, records=RECORDS).encode
    kind = node.WhichOneof("kind")
    fitting = {"str": "append_str", "ints": "append_ints", "list": "append_items", "tuple": "append_items"}
    if fits:
        which = data.draw(st.sampled_from(["set", fitting[kind]] if kind in fitting else ["set"]))
    else:
        which = data.draw(st.sampled_from(["set", "append_str", "append_ints", "append_items"]))
    if which == "set":
        return pb.PatchOp(path=path, set=encode(data.draw(trees)))
    if which == "append_str":
        return pb.PatchOp(path=path, append_str=data.draw(st.text(max_size=3)))
    if which == "append_ints":
        return pb.PatchOp(path=path, append_ints=pb.Ints(values=data.draw(st.lists(st.integers(-5, 5), max_size=3))))
    return pb.PatchOp(path=path, append_items=pb.Items(items=[encode(x) for x in data.draw(st.lists(trees, max_size=2))]))


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_a_client_decodes_any_patch_as_it_decodes_the_whole_state(data: st.DataObject) -> None:
    """Patches a server might send, fitting or not: the item built on the item before is the
    whole state decoded, and a patch is refused by both ways alike."""
    first = Encoder(by_identity, records=RECORDS).encode(data.draw(trees))
    reference, decoded = StreamState(), DecodedStream(CLIENT_DECODER)
    reference.full(first)
    decoded.item(pb.MuxEvent(value=first))
    for i in range(data.draw(st.integers(1, 4))):
        assert reference.value is not None
        if reference.shape is not None and data.draw(st.booleans()):     # a row, of the right kinds or not
            row = pb.PatchRow(strs=[data.draw(st.text(max_size=2)) for _, kind in reference.shape
                                    if kind in ("append_str", "set_str")])
            for _, kind in reference.shape:
                if kind == "append_ints":
                    row.ints.extend([1, data.draw(st.integers(-5, 5))])
                elif kind == "set_int":
                    row.ints.append(data.draw(st.integers(-5, 5)))
                elif kind == "set_float":
                    row.floats.append(data.draw(st.sampled_from([0.0, -0.0, 2.5, math.nan])))
            if data.draw(st.integers(0, 4)) == 0:
                row.ints.append(1)
            msg = pb.MuxEvent(patch=pb.StreamPatch(row=row))
        else:
            msg = pb.MuxEvent(patch=pb.StreamPatch(ops=[random_op(data, reference.value)
                                                       for _ in range(data.draw(st.integers(0, 3)))]))
        try:
            expected = CLIENT_DECODER.decode(reference.item(msg))
        except CodecError:
            with pytest.raises(CodecError):
                decoded.item(msg)
            return
        assert_same(decoded.item(msg), expected, f"patch {i}")


# --- vLLM's own output records, as its output processor changes them ------------------------------

def vllm_records() -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput
    from vllm.v1.metrics.stats import RequestStateStats
    return RequestOutput, CompletionOutput, RequestStateStats, Logprob


def request_outputs(kind: str) -> Iterator[Any]:
    """vLLM's records as its output processor makes them (`kind`: cumulative, delta, or delta with
    two sequences, with logprobs; or cumulative without them, "plain"): the token and logprob lists
    and the stats object are the same objects from item to item, changed in place."""
    plain = kind == "plain"
    kind = "cumulative" if plain else kind
    RequestOutput, CompletionOutput, RequestStateStats, Logprob = vllm_records()
    stats = RequestStateStats(arrival_time=1.5)
    tokens: list[int] = []
    logprobs: list[dict[int, Any]] = []
    prompt_logprobs = [None, {3: Logprob(-1.0, 1, "a")}]
    text = ""
    for i in range(6):
        child = i % 2 if kind == "n2-delta" else 0
        tokens.append(10 + i)
        logprobs.append({10 + i: Logprob(-0.5 * i, 1, f"t{i}")})
        stats.num_generation_tokens += 1
        stats.last_token_ts = 2.0 + i
        text += f" t{i}"
        delta = kind != "cumulative"
        done = i == 5
        out = CompletionOutput(index=child, text=f" t{i}" if delta else text,
                               token_ids=[10 + i] if delta else tokens, cumulative_logprob=None if plain else -0.5 * i,
                               logprobs=None if plain else logprobs[-1:] if delta else logprobs,
                               finish_reason="stop" if done else None, stop_reason=15 if done else None)
        yield RequestOutput(request_id="r", prompt="p", prompt_token_ids=[1, 2, 3],
                            prompt_logprobs=prompt_logprobs if i == 0 or not delta else None,
                            outputs=[out], finished=done, metrics=stats, num_cached_tokens=0)


@pytest.mark.parametrize("kind", ["cumulative", "delta", "n2-delta", "plain"])
@pytest.mark.parametrize("declared", [False, True])
def test_request_outputs_stream_as_vllm_makes_them(kind: str, declared: bool) -> None:
    """With and without the adapter's declarations of the fields that grow."""
    import importlib

    from adapters.async_llm import ASYNC_LLM
    RequestOutput = vllm_records()[0]
    RECORDS[RequestOutput] = next(r.fields for r in ASYNC_LLM.records if r.attr == "RequestOutput")
    growing = {getattr(importlib.import_module(g.module), g.attr): frozenset(g.fields)
               for g in ASYNC_LLM.growing} if declared else {}
    try:
        sent = check_stream(request_outputs(kind), growing_fields=growing)
        rows = [m for m in check_stream.rows if m.patch.HasField("row")]      # type: ignore[attr-defined]
        if kind == "plain":     # after the third item, each one changes the same places as the one before
            assert len(rows) == 6 - 3 and all(m.patch.row.strs and m.patch.row.ints and m.patch.row.floats
                                                for m in rows)
            assert sum(m.ByteSize() for m in rows) < sum(m.ByteSize() for m in sent[3:5]) * 3 / 2 / 1.5
        if kind == "cumulative":    # the growing parts grow by appends
            assert {o for m in sent[1:] for _, o in ops(m)} == {"append_str", "append_ints", "append_items", "set"}
            # A client's items are built from the item before: what did not change is shared, what
            # grew is a new list (the earlier item keeps its own).
            items = DecodedStream(CLIENT_DECODER)
            out = [items.item(m) for m in sent]
            for before, after in zip(out, out[1:]):
                assert after["prompt_token_ids"] is before["prompt_token_ids"]
                assert after["outputs"][0]["token_ids"] is not before["outputs"][0]["token_ids"]
                assert len(after["outputs"][0]["token_ids"]) == len(before["outputs"][0]["token_ids"]) + 1
    finally:
        del RECORDS[RequestOutput]


# --- the receiver refuses what does not fit --------------------------------------------------------

def patch_of(*op: pb.PatchOp) -> pb.StreamPatch:
    return pb.StreamPatch(ops=list(op))


@pytest.mark.parametrize("op", [
    pb.PatchOp(path=[5], set=pb.Value(int=1)),                       # no field 5
    pb.PatchOp(path=[0, 0], set=pb.Value(int=1)),                    # a step into a str
    pb.PatchOp(path=[0], append_ints=pb.Ints(values=[1])),           # ints onto a str
    pb.PatchOp(path=[1], append_str="x"),                            # a str onto ints
    pb.PatchOp(path=[0]),                                            # no op
])
def test_a_patch_that_does_not_fit_the_state_is_refused(op: pb.PatchOp) -> None:
    state = StreamState()
    state.full(Encoder(by_identity).encode(Rec(a="s", b=[1, 2])))
    with pytest.raises(CodecError):
        state.patch(patch_of(op))


def row_of(strs: list[str] = [], ints: list[int] = [], floats: list[float] = []) -> pb.StreamPatch:  # noqa: B006
    return pb.StreamPatch(row=pb.PatchRow(strs=strs, ints=ints, floats=floats))


def test_a_row_repeats_the_ops_of_the_patch_before_it_with_new_values() -> None:
    state, decoded = StreamState(), DecodedStream(CLIENT_DECODER)
    first = pb.MuxEvent(value=Encoder(by_identity).encode(Rec(a="s", b=[[1, 2], 0.5, 3, "x"])))
    state.item(first)
    decoded.item(first)
    ops = patch_of(pb.PatchOp(path=[0], append_str="t"), pb.PatchOp(path=[1, 0], append_ints=pb.Ints(values=[3])),
                   pb.PatchOp(path=[1, 1], set=pb.Value(float=1.5)), pb.PatchOp(path=[1, 2], set=pb.Value(int=4)),
                   pb.PatchOp(path=[1, 3], set=pb.Value(str="y")))
    whole = pb.MuxEvent(value=Encoder(by_identity).encode(Rec(a="st", b=[[1, 2, 3], 1.5, 4, "y"])))
    for msg in (pb.MuxEvent(patch=ops), whole):       # a whole item between does not count (a tee's)
        assert state.item(msg) == whole.value
        assert decoded.item(msg) == {"a": "st", "b": [[1, 2, 3], 1.5, 4, "y"], "c": None}
    row = pb.MuxEvent(patch=row_of(["uv", "z"], [2, 4, 5, -7], [2.5]))
    assert CLIENT_DECODER.decode(state.item(row)) == decoded.item(row) == {"a": "stuv", "b": [[1, 2, 3, 4, 5], 2.5, -7, "z"],
                                                                                  "c": None}
    again = pb.MuxEvent(patch=row_of(["", ""], [0, 0], [0.0]))       # and again, after a row
    assert decoded.item(again) == {"a": "stuv", "b": [[1, 2, 3, 4, 5], 0.0, 0, ""], "c": None}


def test_an_append_that_adds_nothing_this_time_does_not_break_a_run_of_rows() -> None:
    """As a token whose text is not yet a whole character adds ids and no text."""
    ids: list[int] = []

    def items() -> Iterator[object]:
        for text in ("a", "ab", "abc", "abc", "abcd", "abcd"):
            ids.append(len(ids))
            yield Plain(x=text, y=ids)

    check_stream(items())
    sent = check_stream.rows      # type: ignore[attr-defined]
    assert [m.patch.HasField("row") for m in sent] == [False, False, True, True, True, True]
    assert list(sent[3].patch.row.strs) == [""] and list(sent[3].patch.row.ints) == [1, 3]


@pytest.mark.parametrize(("before", "row"), [
    (None, row_of(["x"])),                                                     # no patch before it
    (patch_of(), row_of()),                                                    # nothing to repeat
    (patch_of(pb.PatchOp(path=[0], append_str="x")), row_of()),                # too few values
    (patch_of(pb.PatchOp(path=[0], append_str="x")), row_of(["x", "y"])),      # too many
    (patch_of(pb.PatchOp(path=[0], append_str="x")), row_of(["x"], [1])),      # values of another kind
    (patch_of(pb.PatchOp(path=[1], append_ints=pb.Ints(values=[1]))), row_of([], [2, 1])),   # count past the end
    (patch_of(pb.PatchOp(path=[1], append_ints=pb.Ints(values=[1]))), row_of([], [-1])),     # a negative count
    (patch_of(pb.PatchOp(path=[1], set=pb.Value(list=pb.Items()))), row_of()),              # a set no row carries
    (patch_of(pb.PatchOp(path=[0], append_str="x")),
     pb.StreamPatch(ops=[pb.PatchOp(path=[0], append_str="x")], row=pb.PatchRow(strs=["x"]))),   # ops and a row
])
def test_a_row_that_does_not_follow_the_patch_before_it_is_refused(before: pb.StreamPatch | None,
                                                                   row: pb.StreamPatch) -> None:
    for receiver in (StreamState(), DecodedStream(CLIENT_DECODER)):
        receiver.item(pb.MuxEvent(value=Encoder(by_identity).encode(Rec(a="s", b=[1, 2]))))
        if before is not None:
            receiver.item(pb.MuxEvent(patch=before))
        with pytest.raises(CodecError, match="row|ops or a row"):
            receiver.item(pb.MuxEvent(patch=row))


def test_a_patch_before_any_value_is_refused() -> None:
    with pytest.raises(CodecError):
        StreamState().patch(patch_of())


def test_the_state_is_a_copy_of_what_arrived() -> None:
    msg = pb.StreamItem(value=Encoder(by_identity).encode(["a"]))
    state = StreamState()
    state.item(msg)
    state.patch(patch_of(pb.PatchOp(path=[0], append_str="b")))
    assert msg.value.list.items[0].str == "a" and state.value is not None and state.value.list.items[0].str == "ab"


# --- asking for it ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("asked", "used"), [(None, None), ("patch-v1", STREAM_PATCH_V1), ("full", STREAM_FULL),
                                             ("patch-v9, patch-v1", STREAM_PATCH_V1), ("patch-v9", STREAM_FULL),
                                             ("patch-v2,patch-v1", STREAM_PATCH_V2), ("patch-v1,patch-v2", STREAM_PATCH_V1),
                                             (" full ,patch-v1", STREAM_FULL), ("", STREAM_FULL)])
def test_the_first_known_encoding_a_caller_lists_is_used(asked: str | None, used: str | None) -> None:
    md = [] if asked is None else [("x-bridge-stream-encoding", asked)]
    assert parse_metadata(md).stream_encoding == used
    if asked is not None:
        assert ("x-bridge-stream-encoding", asked) in to_metadata(RuntimeOptions(stream_encoding=asked))
