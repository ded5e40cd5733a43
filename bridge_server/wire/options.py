"""A call's runtime options: the metadata keys a client sets, how they are read and written, and the
timeout profiles they name.

Runtime options travel as gRPC metadata rather than inside the payload so that a router can route a
call (by session, pool, affinity, refs) without decoding it, and so that they mean the same thing
for unary and streaming calls (a Multiplex start carries the same pairs in its message).
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import grpc

from bridge_server.wire.errors import BridgeError, quote

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
MD_STREAM_TEE = "x-bridge-stream-tee"     # "1": with patch-v*, every item twice (a patch, then whole)
# Sent back by a worker in the trailing metadata of every successful gRPC call: the live refs it
# holds (the pool router reads the same count from its lanes' `MuxReply.worker_refs`).
MD_WORKER_REFS = "x-bridge-worker-refs"
# Set by the pool server on each rank's share of a Collective: in a distributed pool, calls that talk
# to every rank run only then (on one rank alone they would wait forever for the others).
MD_COLLECTIVE = "x-bridge-collective"
# A rank's share of a Collective to be bound and checked, and described, but not run: every rank's is,
# before any rank runs its own (`pool/collective.py`).
COLLECTIVE_CHECK = "check"
# Set by the pool server on what it sends its workers: the identity of the client it serves.
MD_IDENTITY = "x-bridge-identity"
# Set by the pool server: the client as its queue tells clients apart (the identity, else the
# connection), for what a worker shares out fairly between callers (turns of costly results).
MD_CLIENT = "x-bridge-client"
# Keys only the pool server sets, on what it sends its workers: it drops them from what clients send.
ROUTER_ONLY_KEYS = frozenset({MD_COLLECTIVE, MD_IDENTITY, MD_CLIENT})
# How the pool server names, in MD_CLIENT, an unauthenticated client's Multiplex stream: its connection
# and the stream (each stream is a client of its own for fairness; `connection_of` takes it back).
_MULTIPLEX_OF = " multiplex "


def multiplex_client(connection: str, stream: int) -> str:
    """An unauthenticated client's Multiplex stream as the pool server's queue knows it."""
    return f"{connection}{_MULTIPLEX_OF}{stream}"


def connection_of(client: str) -> str:
    """The connection of a client key without an identity (a peer address, or one of its Multiplex
    streams): whose a request is, where the server cannot tell clients apart by who they are."""
    return client.partition(_MULTIPLEX_OF)[0]

DEFAULT_SESSION = "default"
AFFINITY_MODES = ("hint", "strict_queue", "strict_fail_fast")
# Stream encodings by their metadata names (the `StreamEncoding` enum of the .proto).
STREAM_FULL = "full"
STREAM_PATCH_V1 = "patch-v1"
STREAM_PATCH_V2 = "patch-v2"      # patch-v1, plus rows
STREAM_ENCODINGS = (STREAM_FULL, STREAM_PATCH_V1, STREAM_PATCH_V2)
STREAM_PATCHES = (STREAM_PATCH_V1, STREAM_PATCH_V2)


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
    collective_check: bool = False           # ... to be checked only, not run (COLLECTIVE_CHECK)
    identity: str = ""                       # the client the pool server serves (set by the pool server)
    client: str = ""                         # the same client as the pool server's queue knows it (set by it)
    # How stream items travel: sent as the caller's list of preferences; parsed, the first name this
    # side knows (None: not asked for, which means STREAM_FULL).
    stream_encoding: str | None = None
    # For checking a receiver's patch decoding: with patch-v1, each item is sent as a patch and then
    # again whole, encoded at the same moment, so that the two decoded values can be compared.
    stream_tee: bool = False


# Milliseconds as clients write them: ASCII digits, maybe a fraction, or "inf" (none). Python's float()
# takes more (Arabic-Indic digits, "5_000", " 5 ", "1e3", "nan"), which a header could not carry but a
# Multiplex start's options can: one form on every path.
_MILLISECONDS = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?|inf)", re.ASCII)


def _ms(key: str, raw: str) -> float | None:
    if not _MILLISECONDS.fullmatch(raw):
        kind = "a non-negative number" if raw.lstrip().startswith("-") or raw.strip().lower() == "nan" else \
            "milliseconds as a number"
        raise BridgeError.validation(f"metadata {key}: expected {kind} (ASCII digits, or inf), got {quote(raw)}",
                                     parameter=key)
    ms = float(raw)
    return None if math.isinf(ms) else ms / 1000.0


# The longest coalescing interval a stream may ask for: an interval holds the stream's slot while
# it waits, and a stream's last item waits out the interval before it (10 s: far past any use).
MAX_STREAM_INTERVAL_MS = 10_000
MAX_METADATA_BYTES = 16 * 1024     # a call's options, keys and values together (gRPC's header limit)

CACHED_METADATA_BYTES = 1024       # larger option sets are parsed each time, never remembered
MAX_RANK_DIGITS = 9
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
        # (a pool has at most a few thousand ranks; int() refuses text of over 4,300 digits, uncaught)
        if not (rank_raw.isascii() and rank_raw.isdigit() and len(rank_raw) <= MAX_RANK_DIGITS):
            raise BridgeError.validation(f"metadata {MD_RANK}: expected a rank number (at most {MAX_RANK_DIGITS} "
                                         f"digits), got {quote(rank_raw)}", parameter=MD_RANK)
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
        refs=_ref_ids(refs),
        rank=rank,
        session_sent=MD_SESSION in md,
        collective=get(MD_COLLECTIVE) in ("1", COLLECTIVE_CHECK),
        collective_check=get(MD_COLLECTIVE) == COLLECTIVE_CHECK,
        identity=get(MD_IDENTITY) or "",
        client=get(MD_CLIENT) or "",
        stream_encoding=None if encodings is None else stream_encoding(encodings),
        stream_tee=get(MD_STREAM_TEE) in ("1", "true"),
    )


def _ref_ids(listed: str | None) -> tuple[str, ...]:
    """x-bridge-refs: ref ids, comma-separated (blanks around each and empty entries are ignored;
    the router refuses an entry that is no ref id, `Router.ref_backend`)."""
    return tuple(dict.fromkeys(r for r in (each.strip() for each in (listed or "").split(",")) if r))


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
