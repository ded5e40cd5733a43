"""The parts of the wire contract that live outside the .proto: metadata keys, runtime options and
timeout profiles.

Runtime options travel as gRPC metadata rather than inside the payload so that a router can route a
call (by session, pool, affinity, refs) without decoding it, and so that they mean the same thing
for unary and streaming calls.
"""

from __future__ import annotations

import asyncio
import functools
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from bridge_server.wire.errors import BridgeError, quote
from vllm_bridge.v1 import bridge_pb2 as pb

# Metadata keys (gRPC metadata keys are lower case ASCII).
MD_SESSION = "x-bridge-session"
MD_TIMEOUT_PROFILE = "x-bridge-timeout-profile"
MD_TIMEOUT_MS = "x-bridge-timeout-ms"
MD_STREAM_TIMEOUT_MS = "x-bridge-stream-timeout-ms"
MD_STREAM_INTERVAL_MS = "x-bridge-stream-interval-ms"
MD_POOL = "x-bridge-pool"
MD_AFFINITY = "x-bridge-affinity"
MD_REFS = "x-bridge-refs"
MD_RANK = "x-bridge-rank"
MD_STREAM_ENCODING = "x-bridge-stream-encoding"
MD_STREAM_TEE = "x-bridge-stream-tee"     # "1": with patch-v1, every item twice (a patch, then whole)
# Sent back by a worker in the trailing metadata of every successful gRPC call: the live refs it
# holds (the pool router reads the same count from its lanes' `MuxReply.worker_refs`).
MD_WORKER_REFS = "x-bridge-worker-refs"
# Set by the pool server on each rank's share of a Collective: in a distributed pool, calls that talk
# to every rank run only then (on one rank alone they would wait forever for the others).
MD_COLLECTIVE = "x-bridge-collective"
# Set by the pool server on what it sends its workers: the identity of the client it serves.
MD_IDENTITY = "x-bridge-identity"
# Set by the pool server: the client as its queue tells clients apart (the identity, else the
# connection), for what a worker shares out fairly between callers (turns of costly results).
MD_CLIENT = "x-bridge-client"
# Keys only the pool server sets, on what it sends its workers: it drops them from what clients send.
ROUTER_ONLY_KEYS = frozenset({MD_COLLECTIVE, MD_IDENTITY, MD_CLIENT})

DEFAULT_SESSION = "default"

# Multiplex: a batch's requests handled before the event loop turns (a server handles a batch a
# slice at a time, so one message of many small starts holds up others no more than many messages).
MUX_BATCH_SLICE = 64

# Channel and server options shared by every client and server of the protocol: tensors by value
# can be large, and a port must never be silently shared by two servers.
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
GRPC_OPTIONS: list[tuple[str, int]] = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                                       ("grpc.so_reuseport", 0)]
AFFINITY_MODES = ("hint", "strict_queue", "strict_fail_fast")
# Stream encodings by their metadata names (the `StreamEncoding` enum of the .proto).
STREAM_FULL = "full"
STREAM_PATCH_V1 = "patch-v1"
STREAM_ENCODINGS = (STREAM_FULL, STREAM_PATCH_V1)

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

M = TypeVar("M", bound=Message)
R = TypeVar("R")


def too_large(size: int, limit: int, rpc: str) -> BridgeError:
    return BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                       f"{rpc}: a request of {size:,} bytes is over this server's limit of {limit:,} "
                       f"(max_request_bytes)", parameter="request", reason="max_request_bytes")


def host_of(caller: str) -> str:
    """The host a caller's connection comes from (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`, with a
    Multiplex stream's suffix or not): its peer address less the port. Any other caller (an
    identity, a Unix socket's peer) is its own host."""
    if caller.startswith(("ipv4:", "ipv6:")):
        address = caller.split(" ", 1)[0]
        return address.rsplit(":", 1)[0]
    return caller


def parse_request(cls: type[M], data: bytes, rpc: str, limit: int | None = None) -> M:
    """A request as read off the wire. Bytes that are not a `cls` (truncated, invalid UTF-8 in a
    string, nested past protobuf's depth limit) are the caller's mistake: INVALID_ARGUMENT naming
    the RPC and the message type, refused where they are read and never passed on; more bytes than
    `limit` are RESOURCE_EXHAUSTED, naming the limit."""
    if limit is not None and len(data) > limit:
        raise too_large(len(data), limit, rpc)
    try:
        return cls.FromString(data)
    except (DecodeError, RecursionError, ValueError) as exc:
        raise BridgeError.validation(
            f"{rpc}: the request is not a valid {cls.DESCRIPTOR.full_name} ({len(data)} bytes): {exc}",
            parameter="request") from None


# How a unary-request RPC is served: (the servicer's method, the request's message type, whether
# the method streams its replies by writing on its context).
UnaryMethod = tuple[Callable[..., Awaitable[object]], type[Message], bool]


def parsed_service(service: str, methods: Mapping[str, UnaryMethod]) -> grpc.GenericRpcHandler:
    """A service whose requests are read as bytes and parsed by `parse_request`, for servicers that
    would otherwise be registered with protobuf's own deserializer (the standard health service, our
    Pool service). Bytes that are not the request then get INVALID_ARGUMENT naming the RPC, as on
    every other RPC of ours, instead of gRPC's UNKNOWN "Unexpected DecodeError"."""
    def serve(behavior: Callable[..., Awaitable[object]], request_cls: type[Message],
              rpc: str) -> Callable[..., Awaitable[object]]:
        async def handle(raw: bytes, context: grpc.aio.ServicerContext) -> object:
            try:
                request = parse_request(request_cls, raw, rpc)
            except BridgeError as exc:
                await context.abort_with_status(exc.to_status())
            return await behavior(request, context)
        return handle

    handlers = {}
    for name, (behavior, request_cls, streams) in methods.items():
        make = grpc.unary_stream_rpc_method_handler if streams else grpc.unary_unary_rpc_method_handler
        handlers[name] = make(serve(behavior, request_cls, f"{service}/{name}"),
                              response_serializer=_serialize)
    return grpc.method_handlers_generic_handler(service, handlers)


def _serialize(message: Message) -> bytes:
    return message.SerializeToString()


def health_and_status(health: Any, status: Callable[..., Awaitable[object]]) -> list[grpc.GenericRpcHandler]:
    """The standard health service (`health`: grpcio-health-checking's aio servicer) and our
    `Pool/Status`, as both servers register them."""
    from grpc_health.v1 import health_pb2

    from vllm_bridge.v1 import pool_pb2
    request = health_pb2.HealthCheckRequest
    return [parsed_service(health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                           {"Check": (health.Check, request, False), "Watch": (health.Watch, request, True)}),
            parsed_service(pool_pb2.DESCRIPTOR.services_by_name["Pool"].full_name,
                           {"Status": (status, pool_pb2.StatusRequest, False)})]


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


@dataclass(frozen=True)
class TimeoutProfile:
    """How long a call may run when its caller sets no deadline.

    `call_s` bounds a unary call, and the wait for a stream's first item; `stream_idle_s` bounds the
    gap between two stream items. None means unlimited.
    """

    name: str
    call_s: float | None
    stream_idle_s: float | None


PROFILES: dict[str, TimeoutProfile] = {
    p.name: p
    for p in (
        TimeoutProfile("default", 120.0, 1800.0),
        TimeoutProfile("ml_inference", 600.0, 1800.0),
        TimeoutProfile("batch_job", None, None),
        TimeoutProfile("streaming", 120.0, 1800.0),
    )
}


@dataclass(frozen=True)
class RuntimeOptions:
    """The per-call options a client sent, as read from metadata (None where not sent)."""

    session_id: str = DEFAULT_SESSION
    timeout_profile: str | None = None
    timeout_s: float | None = None
    stream_timeout_s: float | None = None
    stream_interval_s: float | None = None   # coalesce stream items: at most one per interval
    pool: str | None = None
    affinity: str | None = None
    refs: tuple[str, ...] = ()
    rank: int | None = None
    session_sent: bool = False               # the caller named a session (else it is DEFAULT_SESSION)
    collective: bool = False                 # one rank's share of a Collective (set by the pool server)
    identity: str = ""                       # the client the pool server serves (set by the pool server)
    client: str = ""                         # the same client as the pool server's queue knows it (set by it)
    # How stream items travel: sent as the caller's list of preferences; parsed, the first name this
    # side knows (None: not asked for, which means STREAM_FULL).
    stream_encoding: str | None = None
    # For checking a receiver's patch decoding: with patch-v1, each item is sent as a patch and then
    # again whole, encoded at the same moment, so that the two decoded values can be compared.
    stream_tee: bool = False


def _ms(key: str, raw: str) -> float | None:
    try:
        ms = float(raw)
    except ValueError:
        raise BridgeError.validation(f"metadata {key}: expected milliseconds as a number, got {quote(raw)}",
                                     parameter=key) from None
    if ms < 0 or math.isnan(ms):
        raise BridgeError.validation(f"metadata {key}: expected a non-negative number, got {quote(raw)}",
                                     parameter=key)
    return None if math.isinf(ms) else ms / 1000.0


# The longest coalescing interval a stream may ask for: an interval holds the stream's slot while
# it waits, and a stream's last item waits out the interval before it (10 s: far past any use).
MAX_STREAM_INTERVAL_MS = 10_000
MAX_METADATA_BYTES = 16 * 1024     # a call's options, keys and values together (gRPC's header limit)
CACHED_METADATA_BYTES = 1024       # larger option sets are parsed each time, never remembered
MAX_SESSION_ID_CHARS = 256


def parse_metadata(metadata: Iterable[tuple[str, str | bytes]] | None) -> RuntimeOptions:
    """Reads the runtime options; unknown keys are ignored, malformed known ones are refused.

    Callers send the same few option sets over and over (a router forwards each call's options to
    its worker, a client repeats its session's), so parsed sets are remembered: a hit costs a hash
    of the pairs instead of a parse, on every hop of every call. Only small sets are remembered,
    and no set may be larger than gRPC lets headers be: a Multiplex start carries its options in
    the message, where nothing else would bound them."""
    md = metadata if isinstance(metadata, tuple) else tuple(metadata or ())
    size = metadata_bytes(md)
    if size <= CACHED_METADATA_BYTES:
        return _parse_cached(md)
    if size > MAX_METADATA_BYTES:
        raise BridgeError(grpc.StatusCode.RESOURCE_EXHAUSTED, "validation",
                          f"metadata: {size:,} bytes of options, over the limit of {MAX_METADATA_BYTES:,}",
                          parameter="metadata", reason="metadata too large")
    return _parse(md)


def metadata_bytes(metadata: tuple[tuple[str, str | bytes], ...]) -> int:
    return sum(len(k) + len(v) for k, v in metadata)


@functools.lru_cache(maxsize=4096)
def _parse_cached(metadata: tuple[tuple[str, str | bytes], ...]) -> RuntimeOptions:
    return _parse(metadata)       # errors are raised each time, never remembered


def _parse(metadata: tuple[tuple[str, str | bytes], ...]) -> RuntimeOptions:
    md: Mapping[str, str | bytes] = dict(metadata)
    get = lambda k: (v.decode() if isinstance(v := md.get(k), bytes) else v)  # noqa: E731
    profile = get(MD_TIMEOUT_PROFILE)
    if profile is not None and profile not in PROFILES:
        raise BridgeError.validation(
            f"metadata {MD_TIMEOUT_PROFILE}: unknown timeout profile {quote(profile)}; "
            f"expected one of {', '.join(PROFILES)}", parameter=MD_TIMEOUT_PROFILE)
    affinity = get(MD_AFFINITY)
    if affinity is not None and affinity not in AFFINITY_MODES:
        raise BridgeError.validation(
            f"metadata {MD_AFFINITY}: unknown affinity {quote(affinity)}; expected one of "
            f"{', '.join(AFFINITY_MODES)}", parameter=MD_AFFINITY)
    rank_raw = get(MD_RANK)
    rank = None
    if rank_raw is not None:
        if not (rank_raw.isascii() and rank_raw.isdigit()):
            raise BridgeError.validation(f"metadata {MD_RANK}: expected a rank number, got {quote(rank_raw)}",
                                         parameter=MD_RANK)
        rank = int(rank_raw)
    timeout = get(MD_TIMEOUT_MS)
    stream_timeout = get(MD_STREAM_TIMEOUT_MS)
    stream_interval = get(MD_STREAM_INTERVAL_MS)
    refs = get(MD_REFS)
    session = get(MD_SESSION)
    if session is not None and len(session) > MAX_SESSION_ID_CHARS:
        raise BridgeError.validation(f"metadata {MD_SESSION}: a session id of {len(session):,} characters; at most "
                                     f"{MAX_SESSION_ID_CHARS}", parameter=MD_SESSION)
    encodings = get(MD_STREAM_ENCODING)
    interval_s = _ms(MD_STREAM_INTERVAL_MS, stream_interval) if stream_interval is not None else None
    if stream_interval is not None and (interval_s is None or interval_s * 1000 > MAX_STREAM_INTERVAL_MS):
        raise BridgeError.validation(f"metadata {MD_STREAM_INTERVAL_MS}: {quote(stream_interval)} ms is over the "
                                     f"limit of {MAX_STREAM_INTERVAL_MS:,} ms", parameter=MD_STREAM_INTERVAL_MS)
    return RuntimeOptions(
        session_id=session or DEFAULT_SESSION,
        timeout_profile=profile,
        timeout_s=_ms(MD_TIMEOUT_MS, timeout) if timeout is not None else None,
        stream_timeout_s=_ms(MD_STREAM_TIMEOUT_MS, stream_timeout) if stream_timeout is not None else None,
        stream_interval_s=interval_s or None,
        pool=get(MD_POOL),
        affinity=affinity,
        refs=tuple(r for r in (refs or "").split(",") if r),
        rank=rank,
        session_sent=MD_SESSION in md,
        collective=get(MD_COLLECTIVE) == "1",
        identity=get(MD_IDENTITY) or "",
        client=get(MD_CLIENT) or "",
        stream_encoding=None if encodings is None else stream_encoding(encodings),
        stream_tee=get(MD_STREAM_TEE) in ("1", "true"),
    )


def stream_encoding(preferences: str) -> str:
    """The first of a caller's comma-separated stream encodings that this side knows, else STREAM_FULL.
    Unknown names are skipped rather than refused: a newer client may list an encoding this server
    predates, and FULL is always correct."""
    for name in preferences.split(","):
        name = name.strip()
        if name in STREAM_ENCODINGS:
            return name
    return STREAM_FULL


def explicit_timeout(opts: RuntimeOptions, grpc_remaining_s: float | None) -> float | None:
    """A call's explicit timeout: the tighter of its gRPC deadline and `x-bridge-timeout-ms` (None:
    neither). The same rule everywhere a deadline is read, so that no path lets a call run past
    either (the router routes, and a worker runs, within the same time)."""
    if grpc_remaining_s is None:
        return opts.timeout_s
    return grpc_remaining_s if opts.timeout_s is None else min(grpc_remaining_s, opts.timeout_s)


def time_left_s(time_left_ms: float) -> float | None:
    """A Multiplex call's `time_left_ms` in seconds (None for 0: not set); refuses a negative one."""
    if time_left_ms == 0 or time_left_ms == math.inf:
        return None
    if not time_left_ms > 0:
        raise BridgeError.validation(f"Multiplex: start.time_left_ms: expected milliseconds > 0 (or 0 for none), "
                                     f"got {time_left_ms}", parameter="start.time_left_ms")
    return float(time_left_ms) / 1000.0


def to_metadata(opts: RuntimeOptions) -> list[tuple[str, str]]:
    """The inverse of parse_metadata, for clients and for the router's forwarded calls."""
    md = [(MD_SESSION, opts.session_id)]
    if opts.timeout_profile:
        md.append((MD_TIMEOUT_PROFILE, opts.timeout_profile))
    if opts.timeout_s is not None:
        md.append((MD_TIMEOUT_MS, str(round(opts.timeout_s * 1000))))
    if opts.stream_timeout_s is not None:
        md.append((MD_STREAM_TIMEOUT_MS, str(round(opts.stream_timeout_s * 1000))))
    if opts.stream_interval_s is not None:
        md.append((MD_STREAM_INTERVAL_MS, str(round(opts.stream_interval_s * 1000))))
    if opts.pool:
        md.append((MD_POOL, opts.pool))
    if opts.affinity:
        md.append((MD_AFFINITY, opts.affinity))
    if opts.refs:
        md.append((MD_REFS, ",".join(opts.refs)))
    if opts.rank is not None:
        md.append((MD_RANK, str(opts.rank)))
    if opts.stream_encoding is not None:
        md.append((MD_STREAM_ENCODING, opts.stream_encoding))
    if opts.stream_tee:
        md.append((MD_STREAM_TEE, "1"))
    return md
