"""A thin Python client for the Bridge protocol, used by the CLI, the tests and the benchmarks.

It speaks exactly what an Elixir client speaks: typed values, runtime options as metadata, and the
refs a call touches listed in `x-bridge-refs` so a router can route without decoding the payload.
Refs come back as `pb.Ref` messages and are passed back as they are.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import grpc

from bridge_server.wire.codec import Encoder
from bridge_server.wire.decoder import Decoder
from bridge_server.wire.errors import detail_from_rpc_error
from bridge_server.wire.options import STREAM_PATCH_V1, STREAM_PATCH_V2, RuntimeOptions, to_metadata
from bridge_server.wire.protocol import GRPC_OPTIONS
from bridge_server.wire.security import channel, read_token, token_metadata
from bridge_server.wire.streamstate import DecodedStream
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import bridge_pb2_grpc as pb_grpc

# What `stream` asks for unless told otherwise: patches with rows, else patches without (a server
# skips the names it does not know), else whole values (from a server that knows neither), so asking
# costs nothing.
DEFAULT_STREAM_ENCODING = f"{STREAM_PATCH_V2},{STREAM_PATCH_V1}"


class CallError(Exception):
    """A failed call, with the server's status code and structured detail."""

    def __init__(self, err: grpc.RpcError) -> None:
        self._set(err.code(), err.details() or "", detail_from_rpc_error(err))  # type: ignore[attr-defined]

    def _set(self, code: grpc.StatusCode, details: str, detail: pb.ErrorDetail | None) -> None:
        self.code, self.details, self.detail = code, details, detail
        Exception.__init__(self, f"{code.name}: {details}")

    @classmethod
    def from_mux(cls, error: pb.MuxError) -> CallError:
        """A call over a Multiplex stream failed: the same error a plain call would have raised."""
        err = cls.__new__(cls)
        code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
        err._set(code, error.message, error.detail if error.HasField("detail") else None)
        return err

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
    """`token`: a bearer token for servers that ask for one (default: $VLLM_BRIDGE_TOKEN). `tls_ca`:
    speak TLS, trusting this CA (PEM file); with `tls_cert` and `tls_key`, mutual TLS."""

    def __init__(self, address: str, *, options: RuntimeOptions | None = None,
                 channel_options: Sequence[tuple[str, Any]] = (), token: str | None = None,
                 tls_ca: str | None = None, tls_cert: str | None = None, tls_key: str | None = None) -> None:
        self.address = address
        self.channel = channel(address, [*GRPC_OPTIONS, *channel_options], tls_ca, tls_cert, tls_key)
        self.stub = pb_grpc.BridgeStub(self.channel)
        self.options = options or RuntimeOptions()
        self._credentials = token_metadata(token if token is not None else read_token())
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
        return to_metadata(opts) + self._credentials

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
        """Streams the call's items, decoded. Items travel as patches against the item before
        (`stream_encoding="patch-v2,patch-v1"`, the default) or whole (`stream_encoding="full"`); either way
        each item decodes to the same value. Patched items are built from the item before, so
        what did not change (a prompt's token ids, a generation's earlier logprobs) is the same
        object in both, as in vLLM's own outputs: change an item's parts only on a copy."""
        req, refs = self.request(target, args, kwargs)
        call = self.stub.Stream(req, timeout=timeout, metadata=self._metadata(refs, self._streaming(options)))
        items = DecodedStream(self._decoder)
        try:
            for item in call:
                yield items.item(item)
        except grpc.RpcError as err:
            raise CallError(err) from None
        finally:
            call.cancel()

    def _streaming(self, options: dict[str, Any]) -> dict[str, Any]:
        """A stream call's options: the client's stream encoding unless the caller or the client's
        options name one."""
        if "stream_encoding" not in options and self.options.stream_encoding is None:
            options["stream_encoding"] = DEFAULT_STREAM_ENCODING
        return options

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
        try:
            reply = self.stub.Release(pb.ReleaseRequest(ref_ids=ids, session_id=session_id),
                                      metadata=self._credentials)
        except grpc.RpcError as err:
            raise CallError(err) from None
        return int(reply.released)

    def describe(self, prefix: str = "") -> pb.Catalog:
        try:
            return self.stub.Describe(pb.DescribeRequest(prefix=prefix), metadata=self._credentials)
        except grpc.RpcError as err:
            raise CallError(err) from None

    def multiplex(self, timeout: float | None = None, **options: Any) -> Multiplexer:
        """One `Multiplex` stream for many calls from any number of threads; `options` are its defaults."""
        return Multiplexer(self, timeout, options)


# Requests gathered into one message at most: small beside any server's max_request_bytes (64 MiB
# unless an operator sets it lower, and a message over it fails the whole stream); a hundred-odd starts.
BATCH_BYTES = 64 * 1024
BATCH_REQUESTS = 256


def outgoing(requests: queue.SimpleQueue[pb.MuxRequest | None]) -> Iterator[pb.MuxRequest]:
    """The Multiplex requests as they go out: whatever was queued by the time gRPC takes the next
    message leaves as one `MuxBatch` (calls started together then cost one write and one read, not
    one each: what a burst of starts waits on), alone otherwise. A batch never holds more than
    `BATCH_BYTES` of requests, unless a single request does. Ends at None."""
    carried: pb.MuxRequest | None = None
    while True:
        first = carried if carried is not None else requests.get()
        carried = None
        if first is None:
            return
        batch, size = [first], first.ByteSize()
        while len(batch) < BATCH_REQUESTS:
            try:
                more = requests.get_nowait()
            except queue.Empty:
                break
            more_size = 0 if more is None else more.ByteSize()
            if more is None or size + more_size > BATCH_BYTES:
                carried = more if more is not None else _END
                break
            batch.append(more)
            size += more_size
        yield first if len(batch) == 1 else pb.MuxRequest(batch=pb.MuxBatch(requests=batch))
        if carried is _END:
            return


_END = pb.MuxRequest()   # stands for the end (None) met while gathering a batch


class Multiplexer:
    """Calls and streams over one `Multiplex` stream; they behave as `BridgeClient.call`/`stream` do.

    A reader thread hands each event to the queue of its call; decoding happens in the caller's thread.
    """

    def __init__(self, client: BridgeClient, timeout: float | None, options: Mapping[str, Any]) -> None:
        self._client = client
        self._requests: queue.SimpleQueue[pb.MuxRequest | None] = queue.SimpleQueue()
        self._calls: dict[int, queue.SimpleQueue[pb.MuxEvent | CallError]] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._failure: CallError | None = None
        self._replies = client.stub.Multiplex(outgoing(self._requests), timeout=timeout,
                                              metadata=client._metadata([], options))
        self.replies = 0   # replies received: fewer than events when events were batched
        self._reader = threading.Thread(target=self._read, name="bridge-multiplex", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            for reply in self._replies:
                self.replies += 1
                for event in reply.events:
                    with self._lock:
                        q = self._calls.get(event.id)
                    if q is not None:
                        q.put(event)
            failure = CallError.from_mux(pb.MuxError(code=grpc.StatusCode.CANCELLED.value[0],
                                                     message="Multiplex: the stream has ended"))
        except grpc.RpcError as err:
            failure = CallError(err)
        with self._lock:
            self._failure = failure
            for q in self._calls.values():
                q.put(failure)

    def _start(self, target: Target | str, args: tuple[Any, ...], kwargs: Mapping[str, Any] | None,
               stream: bool, timeout: float | None, options: dict[str, Any],
               window: int = 0) -> tuple[int, queue.SimpleQueue[Any]]:
        if timeout is not None:
            options["timeout_s"] = timeout
        req, refs = self._client.request(target, args, kwargs)
        metadata = dict(self._client._metadata(refs, options))
        call_id, q = next(self._ids), queue.SimpleQueue[Any]()
        with self._lock:
            if self._failure is not None:
                raise self._failure
            self._calls[call_id] = q
        self._requests.put(pb.MuxRequest(start=pb.MuxStart(id=call_id, call=req, stream=stream,
                                                           metadata=metadata, window=window)))
        return call_id, q

    def _next(self, q: queue.SimpleQueue[Any]) -> pb.MuxEvent:
        event = q.get()
        if isinstance(event, CallError):
            raise event
        if event.WhichOneof("kind") == "error":
            raise CallError.from_mux(event.error)
        return event  # type: ignore[no-any-return]

    def call(self, target: Target | str, *args: Any, kwargs: Mapping[str, Any] | None = None,
             timeout: float | None = None, **options: Any) -> Any:
        call_id, q = self._start(target, args, kwargs, False, timeout, options)
        try:
            return self._client._decoder.decode(self._next(q).value)
        finally:
            with self._lock:
                self._calls.pop(call_id, None)

    def stream(self, target: Target | str, *args: Any, kwargs: Mapping[str, Any] | None = None,
               timeout: float | None = None, window: int = 32, **options: Any) -> Iterator[Any]:
        """`window`: items the server may send ahead of this consumer (0: no limit); credit goes back
        in halves as items are consumed."""
        call_id, q = self._start(target, args, kwargs, True, timeout, self._client._streaming(options), window)
        step, consumed = max(1, window // 2), 0
        ended = False
        items = DecodedStream(self._client._decoder)
        try:
            while True:
                try:
                    event = self._next(q)
                except CallError:
                    ended = True
                    raise
                if event.WhichOneof("kind") == "end":
                    ended = True
                    return
                yield items.item(event)
                consumed += 1
                if window and consumed == step:
                    self._requests.put(pb.MuxRequest(credit=pb.MuxCredit(id=call_id, events=consumed)))
                    consumed = 0
        finally:
            if not ended:   # the caller stopped early: the server aborts the call
                self._requests.put(pb.MuxRequest(cancel=call_id))
            with self._lock:
                self._calls.pop(call_id, None)

    def close(self) -> None:
        """Ends the stream; calls still running are cancelled."""
        self._requests.put(None)
        self._replies.cancel()
        self._reader.join(10)

    def __enter__(self) -> Multiplexer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
