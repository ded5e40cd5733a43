"""A thin Python client for the Bridge protocol, used by the CLI, the tests and the benchmarks.

It speaks exactly what an Elixir client speaks: typed values, runtime options as metadata, and the
refs a call touches listed in `x-bridge-refs` so a router can route without decoding the payload.
Refs come back as `pb.Ref` messages and are passed back as they are.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from bridge_server.codec import Decoder, Encoder
from bridge_server.errors import detail_from_rpc_error
from bridge_server.protocol import GRPC_OPTIONS, RuntimeOptions, to_metadata
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc


class CallError(Exception):
    """A failed call, with the server's status code and structured detail."""

    def __init__(self, err: grpc.RpcError) -> None:
        self.code: grpc.StatusCode = err.code()  # type: ignore[attr-defined]
        self.details: str = err.details() or ""  # type: ignore[attr-defined]
        self.detail = detail_from_rpc_error(err)
        super().__init__(f"{self.code.name}: {self.details}")

    @property
    def category(self) -> str:
        return self.detail.category if self.detail else ""

    @property
    def reason(self) -> str:
        return self.detail.reason if self.detail else ""


@dataclass(frozen=True)
class Target:
    """Builds `pb.Target`s: `Target.fn("vllm.distributed.divide")`, `Target.method(ref, "sp_local_sizes")`."""

    msg: pb.Target

    @staticmethod
    def fn(name: str) -> Target:
        return Target(pb.Target(kind=pb.Target.FUNCTION, name=name))

    @staticmethod
    def _on(kind: int, receiver: pb.Ref | str, name: str) -> Target:
        if isinstance(receiver, pb.Ref):
            return Target(pb.Target(kind=kind, name=name, ref=receiver))  # type: ignore[arg-type]
        return Target(pb.Target(kind=kind, name=name, object=receiver))  # type: ignore[arg-type]

    @staticmethod
    def method(receiver: pb.Ref | str, name: str) -> Target:
        return Target._on(pb.Target.METHOD, receiver, name)

    @staticmethod
    def get(receiver: pb.Ref | str, name: str) -> Target:
        return Target._on(pb.Target.GET_ATTR, receiver, name)

    @staticmethod
    def set(receiver: pb.Ref | str, name: str) -> Target:
        return Target._on(pb.Target.SET_ATTR, receiver, name)

    @staticmethod
    def iterate(receiver: pb.Ref | str) -> Target:
        return Target._on(pb.Target.ITERATE, receiver, "")


@dataclass(frozen=True)
class EnumMember:
    """A server-side enum member, as a client that lacks the class sees it."""

    type_name: str
    name: str


def _client_decoder() -> Decoder:
    return Decoder(resolve_ref=lambda ref: ref, resolve_type=lambda name: None,
                   unknown_enum=lambda msg: EnumMember(msg.type_name, msg.name))


class BridgeClient:
    def __init__(self, address: str, *, options: RuntimeOptions | None = None) -> None:
        self.address = address
        self.channel = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        self.stub = pb_grpc.BridgeStub(self.channel)
        self.options = options or RuntimeOptions()
        self._decoder = _client_decoder()

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> BridgeClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request(self, target: Target | str, args: tuple[Any, ...] = (), kwargs: Mapping[str, Any] | None = None,
                ) -> tuple[pb.CallRequest, list[str]]:
        """Encodes a call; returns it with the ids of the refs it carries (for the metadata)."""
        refs: list[str] = []

        def keep_ref(obj: object) -> pb.Ref:
            if not isinstance(obj, pb.Ref):
                raise TypeError(f"cannot send {type(obj).__qualname__} by value")
            refs.append(obj.id)
            return obj

        enc = Encoder(make_ref=keep_ref, tensor_max_bytes=1 << 62)
        t = Target.fn(target) if isinstance(target, str) else target
        if t.msg.WhichOneof("receiver") == "ref":
            refs.append(t.msg.ref.id)
        req = pb.CallRequest(target=t.msg, args=[enc.encode(a) for a in args],
                             kwargs={k: enc.encode(v) for k, v in (kwargs or {}).items()})
        return req, refs

    def _metadata(self, refs: list[str], overrides: Mapping[str, Any]) -> list[tuple[str, str]]:
        opts = replace(self.options, **overrides) if overrides else self.options
        if refs:
            opts = replace(opts, refs=tuple(dict.fromkeys(refs)))
        return to_metadata(opts)

    def call(self, target: Target | str, *args: Any, kwargs: Mapping[str, Any] | None = None,
             timeout: float | None = None, **options: Any) -> Any:
        """Runs a call and returns the decoded result. `options` override RuntimeOptions fields."""
        req, refs = self.request(target, args, kwargs)
        try:
            reply = self.stub.Call(req, timeout=timeout, metadata=self._metadata(refs, options))
        except grpc.RpcError as err:
            raise CallError(err) from None
        return self._decoder.decode(reply.value)

    def stream(self, target: Target | str, *args: Any, kwargs: Mapping[str, Any] | None = None,
               timeout: float | None = None, **options: Any) -> Iterator[Any]:
        req, refs = self.request(target, args, kwargs)
        call = self.stub.Stream(req, timeout=timeout, metadata=self._metadata(refs, options))
        try:
            for item in call:
                yield self._decoder.decode(item.value)
        except grpc.RpcError as err:
            raise CallError(err) from None
        finally:
            call.cancel()

    def collective(self, target: Target | str, *args: Any, kwargs: Mapping[str, Any] | None = None,
                   per_rank: Sequence[tuple[tuple[Any, ...], Mapping[str, Any]]] | None = None,
                   timeout: float | None = None, **options: Any) -> list[Any]:
        """Runs the call on every rank of a distributed pool (the same arguments for all, or
        `per_rank` (args, kwargs) pairs in rank order) and returns the results in rank order."""
        refs: list[str] = []
        if per_rank is not None:
            calls = []
            for rank_args, rank_kwargs in per_rank:
                req, used = self.request(target, rank_args, rank_kwargs)
                calls.append(req)
                refs += used
            msg = pb.CollectiveRequest(per_rank=calls)
        else:
            req, refs = self.request(target, args, kwargs)
            msg = pb.CollectiveRequest(call=req)
        try:
            reply = self.stub.Collective(msg, timeout=timeout, metadata=self._metadata(refs, options))
        except grpc.RpcError as err:
            raise CallError(err) from None
        return [self._decoder.decode(r.value) for r in reply.results]

    def release(self, *refs: pb.Ref | str, session_id: str = "") -> int:
        ids = [r.id if isinstance(r, pb.Ref) else r for r in refs]
        return int(self.stub.Release(pb.ReleaseRequest(ref_ids=ids, session_id=session_id)).released)

    def describe(self, prefix: str = "") -> pb.Catalog:
        return self.stub.Describe(pb.DescribeRequest(prefix=prefix))
