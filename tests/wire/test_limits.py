"""Bounds read off the wire before anything parses a request (`wire/protocol.py`): a message's
top-level fields counted from its bytes, however a stranger spells them, and stopping at the bound."""

from __future__ import annotations

import grpc
import pytest

from bridge_server.wire.errors import BridgeError
from bridge_server.wire.protocol import (
    LARGE_REQUEST_BYTES,
    MAX_CALL_FIELDS,
    count_fields,
    length_delimited,
    read_call,
    read_release,
)
from vllm_bridge.v1 import bridge_pb2 as pb


def test_fields_are_counted_as_protobuf_reads_them() -> None:
    request = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="f"),
                             args=[pb.Value(int=1), pb.Value(str="x" * 300), pb.Value()],
                             kwargs={"a": pb.Value(float=1.5), "b": pb.Value(bool=True)})
    data = request.SerializeToString()
    assert count_fields(data, 100) == 6
    assert count_fields(data, 2) == 3            # stops once past the bound
    # Every wire type, an overlong tag (field 1 in two bytes: protobuf takes it) and a group.
    odd = b"\x08\x01" + b"\x11" + b"\x00" * 8 + b"\x8a\x00\x00" + b"\x1d" + b"\x00" * 4 + b"\x23\x08\x01\x24"
    assert len(pb.ReleaseRequest.FromString(b"\x8a\x00\x00" * 5).ref_ids) == 5
    assert count_fields(odd, 100) == 7           # a group's start, its field and its end count
    assert count_fields(b"\x08\x01\x12\x05\x01", 100) == 1   # a length past the end stops the count


def test_a_nested_message_is_found_without_parsing() -> None:
    batch = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest(cancel=i + 1) for i in range(10)]))
    data = batch.SerializeToString()
    spans = length_delimited(data, 4)
    assert spans is not None and [count_fields(data, 100, *span) for span in spans] == [10]
    assert length_delimited(data + data, 4) == [spans[0], (len(data) + spans[0][0], len(data) + spans[0][1])]
    assert length_delimited(pb.MuxRequest(cancel=3).SerializeToString(), 4) == []
    assert length_delimited(b"\x08\x01" * 100 + data, 4) is None     # too many fields to read one by one


def test_a_large_call_of_too_many_arguments_and_a_release_of_too_many_ids_are_refused_unparsed() -> None:
    head = pb.CallRequest(target=pb.Target(kind=pb.Target.FUNCTION, name="f")).SerializeToString()
    many = head + b"\x12\x00" * (LARGE_REQUEST_BYTES // 2)
    with pytest.raises(BridgeError) as err:
        read_call(many, "Call")
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and f"{MAX_CALL_FIELDS:,}" in err.value.message
    big = pb.CallRequest(args=[pb.Value(bytes=bytes(LARGE_REQUEST_BYTES))]).SerializeToString()
    few = head + b"\x12\x00" * 10 + big
    large = read_call(few, "Call")             # read for its target only: its arguments wait for its turn
    assert not isinstance(large, pb.CallRequest) and large.target.name == "f"
    assert len(large.parse().args) == 11
    with pytest.raises(BridgeError) as err:
        read_release(b"\x8a\x00\x00" * 200_000)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "100,000" in err.value.message
    assert list(read_release(pb.ReleaseRequest(ref_ids=["w.a", "w.b"]).SerializeToString()).ref_ids) == ["w.a", "w.b"]
    for bad in ("zzz", "w.", ".t", "\x00"):          # released nothing, and said nothing
        with pytest.raises(BridgeError) as err:
            read_release(pb.ReleaseRequest(ref_ids=["w.a", bad]).SerializeToString())
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and err.value.parameter == "ref_ids[1]", err.value
        assert "is not a ref id" in err.value.message


def test_a_batch_is_counted_in_all_its_parts_and_a_request_of_many_fields_is_refused() -> None:
    from bridge_server.wire.protocol import MUX_MAX_BATCH, large_batch_within_limit

    part = pb.MuxRequest(batch=pb.MuxBatch(requests=[pb.MuxRequest()] * (MUX_MAX_BATCH // 2 + 1))).SerializeToString()
    large_batch_within_limit(part)
    with pytest.raises(BridgeError) as err:
        large_batch_within_limit(part + part)          # protobuf would merge them: one batch, over the limit
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    with pytest.raises(BridgeError):
        large_batch_within_limit(b"\x10\x00" * 64 + part)
