"""The parts of the wire contract that live outside the .proto, up to parsing: what every server
and channel of the protocol is set up with, who a caller's host is, and how a request is read off
the wire and bounded before it is parsed (its fields counted, its size, a Multiplex batch's
requests). A call's options from metadata are `options.py`.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from bridge_server.wire.errors import BridgeError, abort, quote
from bridge_server.wire.options import MAX_SESSION_ID_CHARS
from vllm_bridge.v1 import bridge_pb2 as pb

# Multiplex: a batch's requests handled before the event loop turns (a server handles a batch a
# slice at a time, so one message of many small starts holds up others no more than many messages).
MUX_BATCH_SLICE = 64
# Requests in one MuxBatch at most. Handling 30 million empty requests of one 57 MiB batch, a slice at
# a time, kept the reader busy for minutes and their parsed views (1.4 GB) alive throughout.
MUX_MAX_BATCH = 65_536

# Channel and server options shared by every client and server of the protocol: tensors by value
# can be large, and a port must never be silently shared by two servers.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS: list[tuple[str, int]] = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.so_reuseport", 0)]

# Keepalive: a client may ping a connection that carries no data (a long `batch_job` call, a stream
# waiting for its first item) every MIN_PING_INTERVAL_S or more without being cut off; gRPC's
# default server policy counts any ping within 5 minutes as abuse and closes the connection after
# two. Pinging more often than this still counts against the client, so a ping flood is cut.
MIN_PING_INTERVAL_S = 10.0


def server_options(min_ping_interval_s: float = MIN_PING_INTERVAL_S) -> list[tuple[str, int]]:
    """The gRPC options of every server of ours."""
    ms = int(min_ping_interval_s * 1000)
    return GRPC_OPTIONS + [("grpc.keepalive_permit_without_calls", 1),
                           ("grpc.http2.min_recv_ping_interval_without_data_ms", ms),
                           ("grpc.http2.min_ping_interval_without_data_ms", ms)]

# What one connection, or all of them, may hold of a server that strangers reach (the pool server):
# one raw HTTP/2 connection had opened 30,000 calls at once (gRPC sets no bound), and other clients'
# calls failed CANCELLED; 20,000 connections that never sent a call took every open file the pool
# server had, so no new client could connect and a worker that died could not be started again (a
# 334 s outage). A connection opens at most MAX_STREAMS_PER_CONNECTION calls at once (a client's
# further ones wait in its own HTTP/2 queue); one with no call for MAX_CONNECTION_IDLE_S is closed
# (clients reconnect on their next call); a handshake not done in HANDSHAKE_TIMEOUT_S is dropped; and
# connections together stay below the open files, leaving FILES_KEPT_BACK (or a quarter, if more; at
# most half) to the server itself: past them new connections are closed as they come, while the pool
# serves on.
MAX_STREAMS_PER_CONNECTION = 4096
MAX_CONNECTION_IDLE_S = 300
HANDSHAKE_TIMEOUT_S = 10
SETTINGS_ACK_S = 5
FILES_KEPT_BACK = 1024


def connection_limit(open_files: int) -> int:
    """The connections a server with `open_files` open files (its soft RLIMIT_NOFILE) accepts at once."""
    return max(16, open_files - max(min(FILES_KEPT_BACK, open_files // 2), open_files // 4))


def public_server_options(min_ping_interval_s: float, max_connections: int) -> list[tuple[str, int]]:
    """`server_options`, and the bounds of a server that strangers reach (above)."""
    return server_options(min_ping_interval_s) + [
        ("grpc.max_concurrent_streams", MAX_STREAMS_PER_CONNECTION),
        ("grpc.max_connection_idle_ms", MAX_CONNECTION_IDLE_S * 1000),
        ("grpc.server_handshake_timeout_ms", HANDSHAKE_TIMEOUT_S * 1000),
        # gRPC holds a call's headers to its 16 KiB limit only once the client has acknowledged the
        # server's HTTP/2 settings; until then a header list may be up to 16 MiB, and headers the
        # services never see (`:authority`, `grpc-trace-bin`) are not counted by the gate: 600 health
        # watches of 2 MB kept 0.7 GB for as long as their connection stayed open without acknowledging
        # (a minute, gRPC's default). A client acknowledges within a round trip.
        ("grpc.http2.settings_timeout", SETTINGS_ACK_S * 1000),
        ("grpc.max_allowed_incoming_connections", max_connections),
        # what a call's sender may send before anything reads it stays HTTP/2's first window (64 KiB),
        # not a window grown to the link's speed: calls waiting for a place to be read (`receiving.py`)
        # held ~10 MB each so (a request being read still gets a window for all of it)
        ("grpc.http2.bdp_probe", 0)] + UNCOMPRESSED_REQUESTS


# Requests arrive as sent: a compressed one is refused by gRPC (UNIMPLEMENTED, "Compression algorithm
# 'gzip' is disabled"). 200 Calls of 60 MiB gzipped to 61 KB each (12 MB sent in all) had the server
# inflate 12 GB, past every bound that counts what a sender sends, and a bystander's `divide` took 31 s.
UNCOMPRESSED_REQUESTS = [("grpc.compression_enabled_algorithms_bitset", 1)]


M = TypeVar("M", bound=Message)
R = TypeVar("R")


def too_large(size: int, limit: int, rpc: str) -> BridgeError:
    return BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                       f"{rpc}: a request of {size:,} bytes is over this server's limit of {limit:,} "
                       f"(max_request_bytes)", parameter="request", reason="max_request_bytes")


def host_of(caller: str) -> str:
    """The host a caller's connection comes from (`ipv4:10.0.0.1:5000`, `ipv6:[2001:db8::7]:5000`, with
    a Multiplex stream's suffix or not): its peer address less the port, where one party holds no
    more than one address. Loopback addresses (all of 127.0.0.0/8 and ::1) are one host: this
    machine, from whichever of them it connects; an IPv6 address is its /64, which one subscriber
    holds whole (a stranger who gave each connection another address of either was thousands of
    hosts); an IPv4-mapped IPv6 address is its IPv4 one. Any other caller (an identity, a Unix
    socket's peer) is its own host."""
    if caller.startswith(("ipv4:", "ipv6:")):
        return _host_of_address(caller.split(" ", 1)[0].rsplit(":", 1)[0])
    return caller


@functools.lru_cache(maxsize=4096)
def _host_of_address(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address[5:].strip("[]"))
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "loopback"
    if isinstance(ip, ipaddress.IPv6Address):
        return f"ipv6:[{ipaddress.IPv6Network((ip, 64), strict=False).network_address}]/64"
    return f"ipv4:{ip}"


def parse_request(cls: type[M], data: bytes, rpc: str, limit: int | None = None,
                  shown: type[Message] | None = None) -> M:
    """A request as read off the wire. Bytes that are not a `cls` (truncated, invalid UTF-8 in a
    string, nested past protobuf's depth limit) are the caller's mistake: INVALID_ARGUMENT naming
    the RPC and the message type (`shown`'s, for a view of it: the type the caller sent), refused
    where they are read and never passed on; more bytes than `limit` are RESOURCE_EXHAUSTED, naming
    the limit."""
    if limit is not None and len(data) > limit:
        raise too_large(len(data), limit, rpc)
    try:
        return cls.FromString(data)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise BridgeError.validation(
            f"{rpc}: the request is not a valid {(shown or cls).DESCRIPTOR.full_name} ({len(data)} bytes): {exc}",
            parameter="request") from None


def count_fields(data: bytes, at_most: int, start: int = 0, end: int | None = None) -> int:
    """How many fields the serialized message `data[start:end]` holds at its top level (a group's
    fields included), read off the wire format without parsing it, and stopping past `at_most`. Why:
    protobuf parses a message whole, in one call nothing can cut short, and thirty million empty
    fields (2 bytes each) cost it 1 s and 1.5 GB; this costs ~1 µs per field, up to the bound."""
    n = 0
    for _ in _fields(data, start, len(data) if end is None else end):
        n += 1
        if n > at_most:
            break
    return n


def length_delimited(data: bytes, field_number: int, at_most: int = 64) -> list[tuple[int, int]] | None:
    """Where each top-level field `field_number` (a message; protobuf merges repeats of it into one)
    lies in `data`, as (start, end), read off the wire without parsing: to count a nested message's
    fields (`count_fields`) before anything parses it. None when the message has more than
    `at_most` top-level fields (more than any valid one has)."""
    found = []
    for n, (tag, begin, stop) in enumerate(_fields(data, 0, len(data))):
        if n >= at_most:
            return None
        if tag >> 3 == field_number and tag & 7 == 2:
            found.append((begin, stop))
    return found


def _fields(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """Each top-level field of `data[start:end]` as (tag, where its value begins, where it ends), as
    protobuf reads them (overlong varints; a group's start and end are fields of their own, its
    fields too). Stops at bytes that run past the end or are no field: the parse refuses those."""
    i = start
    while i < end:
        tag, i = _varint(data, i, end)
        wire_type = tag & 7
        begin = i
        if wire_type == 0:
            _, i = _varint(data, i, end)
        elif wire_type == 1:
            i += 8
        elif wire_type == 2:
            length, begin = _varint(data, i, end)
            i = begin + length
        elif wire_type == 5:
            i += 4
        elif wire_type not in (3, 4):
            return
        if i > end:
            return
        yield tag, begin, i


def _varint(data: bytes, i: int, end: int) -> tuple[int, int]:
    value = shift = 0
    while i < end and shift < 70:
        b = data[i]
        i += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, i
        shift += 7
    return 0, end + 1      # cut short


# Top-level fields of one CallRequest at most: its target, arguments and keyword arguments. A
# function takes a few dozen; thirty million empty arguments cost the pool server 7 GB to parse, and
# a worker's decoding of 15 million held its loop 9.5 s.
MAX_CALL_FIELDS = 4096


def call_within_limit(data: bytes, rpc: str) -> None:
    """Refuses, before any parse, a CallRequest of more than MAX_CALL_FIELDS arguments in all."""
    if count_fields(data, MAX_CALL_FIELDS) > MAX_CALL_FIELDS:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"{rpc}: a call of more than {MAX_CALL_FIELDS:,} arguments and keyword arguments is over "
                          f"this server's limit (pass many values as one list)", parameter="args",
                          reason="too many arguments")


# A request this large is not parsed whole where it is read. Protobuf parses a message in one call
# that holds the reader's loop (and the GIL) throughout, and a message of many tiny values grows ~25
# times when parsed: 57 MiB of empty values took the pool server's loop 1 s and 1.5 GB per copy, and
# a few such requests stalled every caller 40 s. Below this size a parse costs under ~5 ms.
LARGE_REQUEST_BYTES = 256 << 10


@dataclass(frozen=True)
class LargeRequest:
    """A CallRequest of LARGE_REQUEST_BYTES or more, read for its target only: the worker parses the
    rest in the caller's turn, together with decoding it, so that one parse at a time holds the loop
    and each parsed tree is gone once its values are decoded."""

    target: pb.Target
    raw: bytes
    rpc: str
    limit: int | None = None

    def parse(self) -> pb.CallRequest:
        return parse_request(pb.CallRequest, self.raw, self.rpc, self.limit)


def read_call(data: bytes, rpc: str, limit: int | None = None) -> pb.CallRequest | LargeRequest:
    """A CallRequest as a worker reads it: parsed at once when small, else a `LargeRequest`."""
    if len(data) < LARGE_REQUEST_BYTES:
        return parse_request(pb.CallRequest, data, rpc, limit)
    return LargeRequest(read_large_call(data, rpc, limit, pb.CallTargetView).target, data, rpc, limit)


def read_large_call(data: bytes, rpc: str, limit: int | None, view: type[M]) -> M:
    """A large CallRequest read through `view` (one that leaves its arguments unparsed), once its
    size and its count of arguments are within bounds; errors name CallRequest, the type sent."""
    if limit is not None and len(data) > limit:
        raise too_large(len(data), limit, rpc)
    call_within_limit(data, rpc)     # counted before the view holds one object for each
    return parse_request(view, data, rpc, shown=pb.CallRequest)


MAX_RELEASE_IDS = 100_000      # ref ids in one Release (a client holds at most max_refs_per_client per worker)


def collective_calls(request: pb.CollectiveRequestView) -> list[bytes]:
    """A Collective's calls as given: the one `call` (for every rank) or `per_rank`, never both,
    since which of them to run would be a guess."""
    if request.per_rank and request.call:
        raise BridgeError.validation("Collective: give `call` (the same call on every rank) or `per_rank` (one per "
                                     "rank), not both: which to run would be a guess", parameter="call")
    if request.per_rank:
        return list(request.per_rank)
    if request.call:
        return [request.call]
    raise BridgeError.validation("Collective: give `call` (the same call on every rank) or `per_rank`",
                                 parameter="call")


def read_release(data: bytes, limit: int | None = None) -> pb.ReleaseRequest:
    """A ReleaseRequest of at most MAX_RELEASE_IDS ids, counted before the parse when it is large:
    parsed first and counted after, 30 million empty ids (57 MiB) took the reader's loop 0.9 s and
    1 GB."""
    if limit is not None and len(data) > limit:
        raise too_large(len(data), limit, "Release")
    # A small one is parsed at once (it holds few fields); a large one is counted first.
    request = None
    if len(data) < LARGE_REQUEST_BYTES or count_fields(data, MAX_RELEASE_IDS + 1) <= MAX_RELEASE_IDS + 1:
        request = parse_request(pb.ReleaseRequest, data, "Release")
        if len(request.session_id) > MAX_SESSION_ID_CHARS:     # no session has such a name: say so, as its header does
            raise BridgeError.validation(f"Release: a session id of {len(request.session_id):,} characters; at most "
                                         f"{MAX_SESSION_ID_CHARS}", parameter="session_id")
        if len(request.ref_ids) <= MAX_RELEASE_IDS:
            for i, ref in enumerate(request.ref_ids):     # (an unknown, or gone, ref id releases nothing)
                worker, dot, token = ref.partition(".")
                if not (worker and dot and token):
                    raise BridgeError.validation(f"Release: ref_ids[{i}]: {quote(ref, 80)} is not a ref id (a Ref's "
                                                 f"id: its worker's id, a dot and a token)", parameter=f"ref_ids[{i}]")
            return request
    said = f"{len(request.ref_ids):,} ref ids" if request is not None else f"more than {MAX_RELEASE_IDS:,} fields"
    raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                      f"Release: {said} in one request is over this server's limit of {MAX_RELEASE_IDS:,} ref ids "
                      f"(release a session to drop all of its refs at once)", parameter="ref_ids",
                      reason="too many ref ids")


# How a unary-request RPC is served: (the servicer's method, the request's message type, whether
# the method streams its replies by writing on its context).
UnaryMethod = tuple[Callable[..., Awaitable[object]], type[Message], bool]


def parsed_service(service: str, methods: Mapping[str, UnaryMethod], max_bytes: int | None = None,
                   what: str = "") -> grpc.GenericRpcHandler:
    """A service whose requests are read as bytes and parsed by `parse_request`, for servicers that
    would otherwise be registered with protobuf's own deserializer (the standard health service, our
    Pool service). Bytes that are not the request then get INVALID_ARGUMENT naming the RPC, as on
    every other RPC of ours, instead of gRPC's UNKNOWN "Unexpected DecodeError"; more than `max_bytes`
    (of requests that are `what`), INVALID_ARGUMENT before any parse."""
    def serve(behavior: Callable[..., Awaitable[object]], request_cls: type[Message],
              rpc: str) -> Callable[..., Awaitable[object]]:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                if max_bytes is not None:
                    small_request(len(raw), max_bytes, rpc, what)
                request = parse_request(request_cls, raw, rpc)
            except BridgeError as exc:
                await abort(context, exc.to_status(), exc)
            del raw     # (a watch lasts)
            return await behavior(request, context)
        return handle

    handlers = {}
    for name, (behavior, request_cls, streams) in methods.items():
        make = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(serve(behavior, request_cls, f"{service}/{name}"),
                              response_serializer=serialize)
    return grpc.method_handlers_generic_handler(service, handlers)


def small_request(size: int, max_bytes: int, rpc: str, what: str, reason: str = "") -> None:
    """INVALID_ARGUMENT for a request of a service whose requests only name something (`what`) and
    are over `max_bytes`, before any parse."""
    if size > max_bytes:
        raise BridgeError(grpc.StatusCode.INVALID_ARGUMENT, "validation", f"{rpc}: a request of {size:,} bytes is "
                          f"over the limit of {max_bytes:,} ({what})", parameter="request", reason=reason)


def serialize(message: Message) -> bytes:
    return message.SerializeToString()


async def stop_reading(requests: AsyncIterator[Any]) -> None:
    """Closes a stream's requests that its handler stops reading before their end. gRPC's reader
    keeps the last message it read until it reads the next, in a cycle with the RPC that only a
    collection frees: a refused 20 MB Multiplex batch stayed after its stream had ended, and an idle
    server collects rarely."""
    close = getattr(requests.__aiter__(), "aclose", None)
    if close is None:
        return
    try:
        await close()
    except RuntimeError:      # being read elsewhere: its reader lets go of it
        pass


def large_batch_within_limit(data: bytes) -> None:
    """batch_within_limit for a MuxRequest's bytes, before any parse: a batch of 30 million empty
    requests cost 1 s and 1.4 GB to parse. A batch given in several parts counts them all (protobuf
    merges them), and a request of many top-level fields is no MuxRequest."""
    spans = length_delimited(data, 4)       # MuxRequest.batch
    if spans is None:
        batch_within_limit(MUX_MAX_BATCH + 1)
        return
    count = 0
    for start, end in spans:
        count += count_fields(data, MUX_MAX_BATCH - count, start, end)
        batch_within_limit(count)


def batch_within_limit(count: int) -> None:
    """Ends the Multiplex stream of a batch over MUX_MAX_BATCH requests: none of them is handled,
    and the client is told why, instead of a reply for each of millions of requests."""
    if count > MUX_MAX_BATCH:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"Multiplex: a batch of {count:,} requests is over the limit of {MUX_MAX_BATCH:,} per "
                          f"message (send them in several batches)", parameter="batch.requests",
                          reason="batch too large")


def mux_refusal(what: str) -> BridgeError:
    """What a Multiplex request that names no call gets (as an error event for id 0), the same from
    a worker and from the pool server: `what` is "kind" (it holds none of the kinds) or "nested" (a
    batch inside a batch)."""
    if what == "nested":
        return BridgeError.validation("Multiplex: a batch holds starts, cancels and credits, not another batch",
                                      parameter="batch.requests")
    return BridgeError.validation("Multiplex: a request must hold start, cancel, credit or batch", parameter="kind")


async def in_slices(requests: Sequence[R], handle: Callable[[R], None], room: asyncio.Event | None = None) -> None:
    """A batch's requests, handled in order, `MUX_BATCH_SLICE` at a time with the event loop free
    between slices: one message of many thousand small starts holds up other calls and connections
    no more than as many messages would. Each waits for `room` to be set, when one is given (the
    stream's own bound on what it may hold for its client)."""
    for i, each in enumerate(requests):
        if room is not None and not room.is_set():
            await room.wait()
        elif i and i % MUX_BATCH_SLICE == 0:
            await asyncio.sleep(0)
        handle(each)


def mux_calls_named(raw: bytes) -> list[int]:
    """The calls a Multiplex request that cannot be taken (too large, or not a MuxRequest) names, so
    each gets its error: a start that heard nothing back would wait for ever. Read through the view
    that leaves calls unparsed (a bad request mostly carries a bad call, not a bad id); a batch names
    every start and credit in it. [0] (no call's id: the stream's) when it names none."""
    try:
        view = pb.MuxRequestView.FromString(raw)
    except (DecodeError, RecursionError, ValueError):
        return [0]
    requests = view.batch.requests if view.WhichOneof("kind") == "batch" else [view]
    ids = [r.start.id if kind == "start" else r.credit.id
           for r in requests if (kind := r.WhichOneof("kind")) in ("start", "credit")]
    return list(dict.fromkeys(i for i in ids if i)) or [0]


MAX_START_OPTIONS = 1024           # a Multiplex start's options, counted before any is read


def start_options_within_limit(count: int, call_id: int) -> None:
    """Refuses a Multiplex start of more options than MAX_START_OPTIONS, counted in the parsed map
    before any is turned into Python (4 million of them took the pool server's loop 5 s before the
    bound of MAX_METADATA_BYTES could refuse them)."""
    if count > MAX_START_OPTIONS:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"Multiplex: call {call_id} has {count:,} options, over the limit of {MAX_START_OPTIONS:,}",
                          parameter="metadata", reason="metadata too large")
