"""Generation throughput, time to first token and CPU per token: the bridge against in-process vLLM
and `vllm serve`.

    python -m bench.bench_engine [--json PATH] [--rounds 6] [--concurrency 8 32 64 256] [--wait-quiet 20]
                                 [--kinds cumulative delta] [--encodings patch-v2 patch-v1 full]
                                 [--stream-interval N] [--ways ...]

For each concurrency level N, N concurrent 64-token generations (temperature 0, ignore_eos, distinct
prompts and request ids) are run as one warm-up round plus `--rounds` measured rounds, three ways,
one after the other so that they never share the machine's CPU cores:

1. bridge      a worker (`python -m bridge_server.cli worker --objects ...`) publishing an engine as
               `engine`; each request is a gRPC `Stream` call of `Target.method("engine", "generate")`
               with (prompt, sampling params map, request id), made from a grpc.aio client here: what
               a client that does not multiplex (grpcurl, `BridgeClient.stream`) costs.
   bridge-mux  the same worker and engine; all requests of the run share one `Multiplex` stream (the
               starts a round issues together leave as one `MuxBatch` message, as the Python client
               sends them; items ready together come back in one reply).
2. in-process  `AsyncLLM.from_engine_args` in a separate Python process (this module, `--phase`),
               iterating `generate` directly: the ceiling the bridge is measured against.
3. vllm-serve  vLLM's OpenAI server (`python -m vllm.entrypoints.openai.api_server`): streamed
               completions over HTTP (aiohttp) from here.

All three use the same engine arguments: the tiny model, float32, max_model_len 256 (more for
`--max-tokens` over 192), enforce_eager, max_num_seqs 16 (`--max-num-seqs`); so from 32 concurrent
requests on they queue, the same way everywhere.

All three also run with one core kept free of vLLM's OpenMP threads (`VLLM_CPU_NUM_OF_RESERVED_CPU=1`,
`--reserved-cpus`), where the machine has two cores or more: serving processes off the OpenMP cores
(vLLM reserves a core per rank itself when it runs several ranks), and what a GPU deployment sees:
model compute that the serving front-end does not slow down. With `--reserved-cpus 0` (vLLM's default
for one engine: OpenMP on every core) the engine's compute and every front-end share the cores, and
each microsecond of front-end or client CPU also slows the engine; on a 2-core machine that mostly
measures how much CPU each way burns per token.

Figures per way and level: aggregate output tokens/s (a round's tokens over its wall time; median
over the measured rounds), time to first token (from issuing a request to its first streamed item;
p50 and p90 over every request of the measured rounds), and CPU per generated token of every process
of the way (below). Then the ratios within the run, for each bridge transport against in-process and
against vllm serve: tok/s, TTFT p50, and the serving process's CPU per token (the worker against the
in-process loop, which is its own client too, or against vllm serve's API server).

The bridge ways stream in the `patch-v2` encoding (each item after the first as the changes from the
one before, as a row of values where it changes what the one before changed; `x-bridge-stream-encoding`),
as the Python client does by default. `--encodings patch-v2 patch-v1 full` also runs them with patches
without rows, and with whole items (what grpcurl or a client that does not ask gets), on the same
worker, for a comparison within the run.

Options for experiments (the client's or the operator's choice; no server change):
- `--kinds cumulative delta final_only`: also run the bridge and in-process ways with that
  `RequestOutputKind` in their sampling params, on the same engine. vllm serve streams deltas anyway.
- `--stream-interval N`: vLLM's engine arg for all three ways (an output every N tokens, the first at
  once). In vLLM 0.14 it only takes effect with the DELTA kind (with CUMULATIVE, vLLM still emits an
  output per token), so pair it with `--kinds delta`.
- `--max-tokens N --logprobs K`: longer generations, with K top logprobs per token. A stream's cost
  per token must not grow with its length (with CUMULATIVE, the bridge patches only what grew).

CPU accounting: during the measured rounds of each level the CPU time of every process involved is
read and reported in microseconds per generated token: the client (this process), the front-end (the
bridge worker; vllm serve's API server; the in-process phase, which is front-end and client in one),
and vLLM's engine core; next to it, the CPU used meanwhile by processes that are not ours. This machine
may be shared: before each level the benchmark waits (up to `--wait-quiet` seconds) for other processes
to leave the CPU alone, and a run with much foreign CPU says so instead of passing off noise as a
result. Runtime: about 6 minutes on a quiet machine (the 256 level takes half of it), plus any waiting.

`--summarize run1.json run2.json ...` measures nothing: it prints the figures of issue 18 (the ratios
above that have goals) over several runs' `--json` files, grouped by reserved cores: the median at
each level and every run's value, so the spread shows.

The clients do as little as they can, so as not to steal CPU from the server they measure: the
bridge client sends a pre-serialized request; with whole items it keeps the stream's raw bytes and
parses only the last item (with the default CUMULATIVE kind it carries every token id; with DELTA
every item is parsed, just deep enough to count its token ids); with patches it applies each to the
stream's state (`StreamState`), as any client must, and looks only at the last; the HTTP client
parses only the final usage chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import enum
import itertools
import json
import math
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import psutil

from bench.common import (
    ROOT,
    exit_on_sigterm,
    free_port,
    machine_info,
    percentile,
    print_table,
    start_worker,
    write_json,
)
from bridge_server.wire.eventloop import freeze_heap

ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
       "VLLM_CPU_KVCACHE_SPACE": "1"}
for _k, _v in ENV.items():
    os.environ.setdefault(_k, _v)

WAYS = ("bridge", "bridge-mux", "in-process", "vllm-serve")
KINDS = ("cumulative", "delta", "final_only")
ENCODINGS = ("patch-v2", "patch-v1", "full")
HEADLINE_ENCODING = "patch-v2"     # what the Python client asks for first
STREAM_METHOD = "/vllm_bridge.v1.Bridge/Stream"
MUX_METHOD = "/vllm_bridge.v1.Bridge/Multiplex"
CONTENDED_CORES = 0.25    # a round during which other processes used more than this is not trusted


# ------------------------------------------------------------------------------------- the workload

@dataclass(frozen=True)
class Workload:
    model: str
    concurrency: tuple[int, ...] = (8, 32, 64, 256)
    rounds: int = 6
    max_tokens: int = 64
    max_num_seqs: int = 16
    stream_interval: int = 1     # vLLM's own default: an output per engine step
    wait_quiet_s: float = 20.0   # per level, for a shared machine: see wait_quiet
    bridge_interval_ms: int = 0  # the bridge's own coalescing (x-bridge-stream-interval-ms); 0: every output
    reserved_cpus: int = 0       # cores vLLM keeps its OpenMP threads off (VLLM_CPU_NUM_OF_RESERVED_CPU)
    logprobs: int = 0            # top logprobs per token (0: none), for every way

    def engine_args(self) -> dict[str, Any]:
        args = {"model": self.model, "dtype": "float32", "max_model_len": self.max_model_len, "enforce_eager": True,
                "max_num_seqs": self.max_num_seqs}
        if self.stream_interval != 1:
            args["stream_interval"] = self.stream_interval
        return args

    @property
    def max_model_len(self) -> int:
        """Room for the prompt (~20 tokens) and the generation."""
        return max(256, self.max_tokens + 64)

    def sampling(self) -> dict[str, Any]:
        extra = {"logprobs": self.logprobs} if self.logprobs else {}
        return {"temperature": 0.0, "max_tokens": self.max_tokens, "ignore_eos": True, **extra}

    def requests(self, tag: str, c: int, r: int) -> list[tuple[str, str]]:
        """[(request_id, prompt)] of round r (0: the warm-up) at concurrency c; the same prompts for
        every way. Every prompt is distinct and starts with its own number, so prefix caching shares
        nothing between requests or rounds; all have the same shape (about 20 tokens)."""
        return [(f"bench-{tag}-c{c}-r{r}-{i}",
                 f"{c * 1000 + r * 100 + i} the worker streams many tokens to request number {i} of round {r} today")
                for i in range(c)]


@dataclass
class Sample:
    """One request: seconds to its first streamed item and to its end, its output tokens and how many
    items (RequestOutputs, SSE chunks) it was streamed in.

    Times count from the start of the round, when every request of the round is issued: that is what
    a caller who submits N requests at once waits for. (Timing from the moment each client gets round
    to sending its own request would hide the queueing inside a client: an in-process client tokenizes
    and submits its requests one after the other on one thread, and the last one's wait would not count.)
    `one()` returns absolute perf_counter() times; run_schedule rebases them."""

    ttft: float
    total: float
    tokens: int
    items: int
    engine_ttft: float | None = None   # vLLM's own metrics.first_token_latency, where it is known


@dataclass
class Round:
    concurrency: int
    warmup: bool
    wall_s: float
    samples: list[Sample]
    foreign_cores: float = 0.0     # CPU used meanwhile by processes not ours
    contended: bool = False

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.samples)


OneRequest = Callable[[str, str], Awaitable[Sample]]     # (request_id, prompt) -> its Sample
Roles = Callable[[], dict[str, list[psutil.Process]]]   # who to charge CPU time to


# ----------------------------------------------------------------------------------- CPU accounting

def _cpu_s(procs: Sequence[psutil.Process]) -> float:
    total = 0.0
    for p in procs:
        with contextlib.suppress(psutil.Error):
            t = p.cpu_times()
            total += t.user + t.system
    return total


def _busy_s() -> float:
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)


class CpuMeter:
    """CPU seconds per role between start() and stop(), and what the rest of the machine used."""

    def __init__(self, roles: Roles) -> None:
        self.roles = roles

    def start(self) -> None:
        self._procs = self.roles()
        self._t0 = {r: _cpu_s(ps) for r, ps in self._procs.items()}
        self._busy0, self._wall0 = _busy_s(), time.perf_counter()

    def stop(self, tokens: int) -> dict[str, Any]:
        used = {r: _cpu_s(ps) - self._t0[r] for r, ps in self._procs.items()}
        busy, wall = _busy_s() - self._busy0, time.perf_counter() - self._wall0
        ours = sum(used.values())
        return {"wall_s": wall, "tokens": tokens, "cpu_s": used, "ours_s": ours, "foreign_s": max(0.0, busy - ours),
                "foreign_cores": max(0.0, busy - ours) / wall if wall else 0.0,
                "us_per_token": {r: s / tokens * 1e6 for r, s in used.items()} if tokens else {}}


def wait_quiet(roles: Roles, max_wait_s: float, threshold_cores: float = 0.15) -> float:
    """Waits (at most max_wait_s) until processes not ours use less than `threshold_cores` over one
    second: on a shared machine a measurement should not start in the middle of someone else's.
    Returns the foreign load last seen, in cores."""
    end = time.monotonic() + max_wait_s
    foreign = 0.0
    while True:
        procs = [p for ps in roles().values() for p in ps]
        ours0, busy0, t0 = _cpu_s(procs), _busy_s(), time.perf_counter()
        time.sleep(1.0)
        foreign = max(0.0, (_busy_s() - busy0) - (_cpu_s(procs) - ours0)) / (time.perf_counter() - t0)
        if foreign < threshold_cores or time.monotonic() >= end:
            return foreign


def children(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


# ------------------------------------------------------------------------------------ measurement

async def run_schedule(work: Workload, one: OneRequest, roles: Roles, tag: str) -> dict[str, Any]:
    """Runs every level's rounds; returns the rounds and, per level, the CPU its measured rounds used.

    A measured round during which processes not ours used more than `CONTENDED_CORES` is marked
    contended and, while the budget of `work.rounds` extra rounds lasts, made up for by another
    round: the figures are then taken from uncontended rounds only (see summarize)."""
    # This process's heap as vLLM's own benchmark client and `vllm serve` leave theirs, and as our
    # servers do: what exists before the rounds is frozen, so no full collection of it (~0.1-0.25 s
    # with torch loaded; with an engine in-process) lands in a round of one way and not another's.
    freeze_heap()
    rounds: list[Round] = []
    cpu: dict[str, Any] = {}
    meter = CpuMeter(roles)
    for c in work.concurrency:
        if work.wait_quiet_s > 0:
            await asyncio.to_thread(wait_quiet, roles, work.wait_quiet_s)
        procs = [p for ps in roles().values() for p in ps]
        clean = extra = 0
        r = 0
        while clean < work.rounds:
            warmup = r == 0
            if r == 1:
                meter.start()
            reqs = work.requests(tag, c, r)
            busy0, ours0 = _busy_s(), _cpu_s(procs)
            t0 = time.perf_counter()
            samples = [dataclasses.replace(s, ttft=s.ttft - t0, total=s.total - t0)
                       for s in await asyncio.gather(*(one(rid, prompt) for rid, prompt in reqs))]
            wall = time.perf_counter() - t0
            foreign = max(0.0, (_busy_s() - busy0) - (_cpu_s(procs) - ours0)) / wall
            bad = sorted({s.tokens for s in samples} - {work.max_tokens})
            if bad:
                raise RuntimeError(f"expected {work.max_tokens} tokens per request, got {bad}")
            contended = foreign > CONTENDED_CORES
            rounds.append(Round(c, warmup, wall, list(samples), foreign, contended))
            r += 1
            if warmup:
                continue
            if not contended or extra >= work.rounds:
                clean += 1
            else:
                extra += 1
        measured = [x for x in rounds if x.concurrency == c and not x.warmup]
        cpu[str(c)] = meter.stop(sum(x.tokens for x in measured))
    return {"rounds": [asdict(x) for x in rounds], "cpu": cpu}


def summarize(data: dict[str, Any], c: int) -> dict[str, Any]:
    """Figures of one level from its measured rounds, leaving out contended ones when enough others
    remain (run_schedule ran extra rounds for them)."""
    every = [r for r in data["rounds"] if r["concurrency"] == c and not r["warmup"]]
    quiet = [r for r in every if not r["contended"]]
    measured = quiet if len(quiet) * 2 > len(every) or len(quiet) >= 3 else every
    rates = [sum(s["tokens"] for s in r["samples"]) / r["wall_s"] for r in measured]
    ttfts = sorted(s["ttft"] * 1e3 for r in measured for s in r["samples"])
    totals = sorted(s["total"] * 1e3 for r in measured for s in r["samples"])
    engine_ttfts = sorted(s["engine_ttft"] * 1e3 for r in measured for s in r["samples"]
                          if s.get("engine_ttft") is not None)
    return {"rounds": len(measured), "contended_rounds": len(every) - len(quiet),
            "skewed": measured is every and len(quiet) < len(every),
            "tok_s": statistics.median(rates), "tok_s_min": min(rates),
            "tok_s_max": max(rates), "tok_s_by_round": rates,
            "ttft_p50_ms": percentile(ttfts, 50), "ttft_p90_ms": percentile(ttfts, 90),
            "request_p50_ms": percentile(totals, 50),
            "items_per_request": statistics.mean(s["items"] for r in measured for s in r["samples"]),
            "engine_ttft_p50_ms": percentile(engine_ttfts, 50) if engine_ttfts else None,
            "cpu": data["cpu"].get(str(c), {})}


# ----------------------------------------------------------------------------------- 1. the bridge

def _request_output_kind(kind: str) -> enum.Enum:
    """A stand-in for vllm.sampling_params.RequestOutputKind: an enum goes on the wire as its type's
    qualified name and the member name, which the worker rebuilds into vLLM's own enum. The client
    needs no vLLM import."""
    cls = enum.Enum("RequestOutputKind", {"CUMULATIVE": 0, "DELTA": 1, "FINAL_ONLY": 2},  # type: ignore[misc]
                    module="vllm.sampling_params")
    return cls[kind.upper()]  # type: ignore[no-any-return]


class _Items:
    """What a bridge client keeps of one stream: its latest item's Value. Patches (the PATCH_V1
    encoding) are applied as they come, as any client must; a whole item is only kept (a later
    patch makes it the state), so with the full encoding nothing is copied or applied."""

    def __init__(self) -> None:
        from bridge_server.wire.streamstate import StreamState
        self.state = StreamState()
        self.whole: Any = None

    def add(self, msg: Any) -> None:
        """`msg`: a parsed StreamItem or MuxEvent carrying an item."""
        if msg.HasField("patch"):
            if self.whole is not None:
                self.state.full(self.whole)
                self.whole = None
            self.state.patch(msg.patch)
        else:
            self.whole = msg.value

    def value(self) -> Any:
        return self.whole if self.whole is not None else self.state.value


def _inspect_item(item_bytes: bytes) -> tuple[int, float | None]:
    from vllm_bridge.v1 import bridge_pb2 as pb
    return _inspect_value(pb.StreamItem.FromString(item_bytes).value)


def _inspect_value(value: Any) -> tuple[int, float | None]:
    """len(outputs[0].token_ids) of one streamed RequestOutput, and its metrics.first_token_latency
    (seconds from the request's arrival in the engine front-end to its first token there), read
    without decoding the rest of the record."""
    tokens, latency = None, None
    for f in value.record.fields:
        if f.name == "outputs":
            seq = f.value.list if f.value.HasField("list") else f.value.tuple
            for g in seq.items[0].record.fields:
                if g.name == "token_ids":
                    kind = g.value.WhichOneof("kind")
                    if kind == "ints":
                        tokens = len(g.value.ints.values)
                    elif kind in ("list", "tuple"):
                        tokens = len(getattr(g.value, kind).items)
                    else:
                        raise ValueError(f"token_ids sent as {kind}")
        elif f.name == "metrics" and f.value.HasField("record"):
            latency = next((g.value.float for g in f.value.record.fields if g.name == "first_token_latency"), None)
    if tokens is None:
        raise ValueError("no outputs[0].token_ids in the streamed item")
    return tokens, latency


def _bridge_request(work: Workload, kind: str,
                    encoding: str) -> tuple[Callable[[str, str], Any], tuple[tuple[str, str], ...]]:
    """What both bridge transports send: a builder of `generate`'s CallRequest for (request id, prompt),
    with the sampling params encoded once, and the call's metadata (with the stream encoding)."""
    from bridge_server.client.client import Target
    from bridge_server.wire.codec import Encoder
    from bridge_server.wire.options import RuntimeOptions, to_metadata
    from vllm_bridge.v1 import bridge_pb2 as pb

    def no_refs(obj: object) -> pb.Ref:
        raise TypeError(f"cannot send {type(obj).__qualname__} by value")

    params = work.sampling()
    if kind != "cumulative":
        params["output_kind"] = _request_output_kind(kind)
    target, params_value = Target.method("engine", "generate").msg, Encoder(make_ref=no_refs).encode(params)
    interval = work.bridge_interval_ms / 1000 if work.bridge_interval_ms else None
    metadata = tuple(to_metadata(RuntimeOptions(session_id="bench", stream_interval_s=interval,
                                                stream_encoding=None if encoding == "full" else encoding)))

    def request(request_id: str, prompt: str) -> Any:
        return pb.CallRequest(target=target, args=[pb.Value(str=prompt), params_value, pb.Value(str=request_id)])
    return request, metadata


async def bridge_measure(work: Workload, address: str, kind: str, roles: Roles,
                         encoding: str = HEADLINE_ENCODING) -> dict[str, Any]:
    import grpc

    from bridge_server.wire.protocol import GRPC_OPTIONS
    from vllm_bridge.v1 import bridge_pb2 as pb

    make_request, metadata = _bridge_request(work, kind, encoding)
    delta = kind == "delta"
    raw_items = encoding == "full" and not delta   # only the last item is ever looked at: parse only it

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        # No (de)serializers: requests go as bytes built up front, items come back as bytes.
        stream = channel.unary_stream(STREAM_METHOD)

        async def one(request_id: str, prompt: str) -> Sample:
            payload = make_request(request_id, prompt).SerializeToString()
            first, last, tokens, items = None, b"", 0, 0
            kept = _Items()
            async for raw in stream(payload, metadata=metadata):
                items += 1
                if first is None:
                    first = time.perf_counter()
                if raw_items:
                    last = raw
                    continue
                kept.add(pb.StreamItem.FromString(raw))
                if delta:
                    tokens += _inspect_value(kept.value())[0]
            end = time.perf_counter()
            if raw_items:
                n, engine_ttft = _inspect_item(last) if last else (0, None)
            else:
                n, engine_ttft = _inspect_value(kept.value()) if items else (0, None)
            return Sample(first or end, end, tokens if delta else n, items, engine_ttft)

        return await run_schedule(work, one, roles, f"bridge-{kind}-{encoding}")


async def bridge_mux_measure(work: Workload, address: str, kind: str, roles: Roles,
                             encoding: str = HEADLINE_ENCODING) -> dict[str, Any]:
    """The same requests over one `Multiplex` stream, as a client that runs many at once would send them."""
    import grpc

    from bridge_server.wire.protocol import GRPC_OPTIONS
    from vllm_bridge.v1 import bridge_pb2 as pb

    make_request, metadata = _bridge_request(work, kind, encoding)
    delta = kind == "delta"

    async with grpc.aio.insecure_channel(address, options=GRPC_OPTIONS) as channel:
        call = channel.stream_stream(MUX_METHOD)(metadata=metadata)
        waiting: dict[int, asyncio.Queue[Any]] = {}
        ids = itertools.count(1)
        # Starts issued in the same loop turn leave as one MuxBatch, as the Python client sends them:
        # one write at a time on a gRPC stream, by one writer.
        pending: list[Any] = []
        wake = asyncio.Event()

        async def send() -> None:
            while True:
                await wake.wait()
                wake.clear()
                while pending:
                    batch = pending[:]
                    pending.clear()
                    msg = batch[0] if len(batch) == 1 else pb.MuxRequest(batch=pb.MuxBatch(requests=batch))
                    await call.write(msg.SerializeToString())

        async def dispatch() -> None:
            while (raw := await call.read()) is not grpc.aio.EOF:
                for event in pb.MuxReply.FromString(raw).events:
                    waiting[event.id].put_nowait(event)

        async def one(request_id: str, prompt: str) -> Sample:
            call_id, events = next(ids), asyncio.Queue[Any]()
            waiting[call_id] = events
            pending.append(pb.MuxRequest(start=pb.MuxStart(id=call_id, stream=True,
                                                           call=make_request(request_id, prompt))))
            wake.set()
            tokens, items = 0, 0
            first = None
            kept = _Items()
            while (event := await events.get()).WhichOneof("kind") in ("value", "patch"):
                items += 1
                if first is None:
                    first = time.perf_counter()
                kept.add(event)
                if delta:
                    tokens += _inspect_value(kept.value())[0]
            end = time.perf_counter()
            del waiting[call_id]
            if event.WhichOneof("kind") == "error":
                raise RuntimeError(f"{request_id}: {event.error.message}")
            n, engine_ttft = _inspect_value(kept.value()) if items else (0, None)
            return Sample(first or end, end, tokens if delta else n, items, engine_ttft)

        reader, sender = asyncio.create_task(dispatch()), asyncio.create_task(send())
        try:
            return await run_schedule(work, one, roles, f"bridge-mux-{kind}-{encoding}")
        finally:
            sender.cancel()
            await call.done_writing()
            reader.cancel()


def run_bridge(work: Workload, kinds: Sequence[str], log_dir: Path,
               transports: Sequence[str] = ("bridge",),
               encodings: Sequence[str] = (HEADLINE_ENCODING,)) -> dict[str, dict[str, Any]]:
    """One worker and engine for both transports: a call per request ("bridge") and one Multiplex
    stream for all ("bridge-mux"), in each stream encoding. Results are keyed by label (way, kind
    and encoding)."""
    objects = [{"name": "engine", "target": "vllm.AsyncLLMEngine.from_engine_args",
                "kwargs": {"engine_args": work.engine_args()}}]
    t0 = time.monotonic()
    server = start_worker("--objects", json.dumps(objects), log_dir=log_dir)
    ready_s = time.monotonic() - t0
    try:
        pid, me = server.proc.pid, psutil.Process()

        def roles() -> dict[str, list[psutil.Process]]:
            return {"client": [me], "front-end": [psutil.Process(pid)], "engine core": children(pid)}

        measure = {"bridge": bridge_measure, "bridge-mux": bridge_mux_measure}
        return {_label(way, kind, encoding): {
                    "ready_s": ready_s, **asyncio.run(measure[way](work, server.address, kind, roles, encoding))}
                for encoding in encodings for way in transports for kind in kinds}
    finally:
        stop_group(server.proc)


# ------------------------------------------------------------------------------- 2. in-process vLLM

async def in_process_measure(work: Workload, kinds: Sequence[str]) -> dict[str, dict[str, Any]]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.async_llm import AsyncLLM

    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**work.engine_args()))
    me = psutil.Process()
    ready_s = time.time() - me.create_time()   # like the others: from process start, imports included

    def roles() -> dict[str, list[psutil.Process]]:
        return {"front-end+client": [me], "engine core": me.children(recursive=True)}

    out = {}
    try:
        for kind in kinds:
            params = SamplingParams(**work.sampling(), output_kind=RequestOutputKind[kind.upper()])
            delta = kind == "delta"

            async def one(request_id: str, prompt: str) -> Sample:
                first, last, tokens, items = None, None, 0, 0
                async for item in engine.generate(prompt, params, request_id):  # noqa: B023
                    items += 1
                    if first is None:
                        first = time.perf_counter()
                    if delta:  # noqa: B023
                        tokens += len(item.outputs[0].token_ids)
                    last = item
                end = time.perf_counter()
                if not delta and last is not None:  # noqa: B023
                    tokens = len(last.outputs[0].token_ids)
                metrics = getattr(last, "metrics", None)
                return Sample(first or end, end, tokens, items,
                              getattr(metrics, "first_token_latency", None))

            out[kind] = {"ready_s": ready_s, **await run_schedule(work, one, roles, f"inproc-{kind}")}
    finally:
        engine.shutdown()
    return out


def run_in_process(work: Workload, kinds: Sequence[str], log_dir: Path) -> dict[str, dict[str, Any]]:
    """Runs `in_process_measure` in a fresh interpreter (this module with --phase) and reads its result."""
    out = log_dir / "in-process.json"
    argv = [sys.executable, "-m", "bench.bench_engine", "--phase", "in-process", "--phase-out", str(out),
            "--phase-workload", json.dumps({**asdict(work), "kinds": list(kinds)})]
    log = log_dir / "in-process.log"
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        rc = proc.wait(600)
    finally:
        stop_group(proc)
    if rc != 0:
        raise RuntimeError(f"the in-process phase exited with {rc}:\n{_tail(log)}")
    return json.loads(out.read_text())  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- 3. vllm serve

async def http_measure(work: Workload, base: str, roles: Roles) -> dict[str, Any]:
    import aiohttp

    url = f"{base}/v1/completions"
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=300)) as session:
        async def one(request_id: str, prompt: str) -> Sample:
            body = {"model": work.model, "prompt": prompt, "stream": True, **work.sampling(),
                    "stream_options": {"include_usage": True}}
            first, chunks, last = None, 0, b""
            async with session.post(url, json=body, headers={"X-Request-Id": request_id}) as resp:
                resp.raise_for_status()
                async for line in resp.content:
                    if not line.startswith(b"data: "):
                        continue
                    data = line[6:].strip()
                    if data == b"[DONE]":
                        break
                    if first is None:
                        first = time.perf_counter()
                    chunks += 1
                    last = data
            end = time.perf_counter()
            usage = json.loads(last).get("usage") if last else None
            tokens = int(usage["completion_tokens"]) if usage else chunks
            return Sample(first or end, end, tokens, chunks - (1 if usage else 0))

        return await run_schedule(work, one, roles, "serve")


def run_vllm_serve(work: Workload, log_dir: Path) -> dict[str, Any]:
    port = free_port()
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", work.model,
            "--dtype", "float32", "--max-model-len", str(work.max_model_len), "--enforce-eager",
            "--max-num-seqs", str(work.max_num_seqs), "--host", "127.0.0.1", "--port", str(port),
            "--disable-uvicorn-access-log", "--stream-interval", str(work.stream_interval)]
    log = log_dir / "vllm-serve.log"
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **ENV}, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = t0 + 180
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{_tail(log)}")
            with contextlib.suppress(OSError):
                if urllib.request.urlopen(f"{base}/health", timeout=1).status == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not ready after 180 s:\n{_tail(log)}")
            time.sleep(0.2)
        ready_s = time.monotonic() - t0
        me = psutil.Process()

        def roles() -> dict[str, list[psutil.Process]]:
            return {"client": [me], "front-end": [psutil.Process(proc.pid)], "engine core": children(proc.pid)}

        return {"ready_s": ready_s, **asyncio.run(http_measure(work, base, roles))}
    finally:
        stop_group(proc)


# --------------------------------------------------------------------------------------- processes

def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process group (a server shuts its engine down), then waits until every process
    of the family is gone, SIGKILLing what lingers: the next phase must have the CPU to itself."""
    family = [psutil.Process(proc.pid)] if proc.poll() is None else []
    family += children(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(30)
    _gone, alive = psutil.wait_procs(family, timeout=10)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=5)
    if proc.poll() is None:
        proc.wait(5)


def _tail(log: Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(log.read_text(errors="replace").splitlines()[-n:])
    return ""


# ------------------------------------------------------------------------------------------ report

def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _front_cpu(level: dict[str, Any]) -> float:
    """The serving process's CPU per token: the worker, vllm serve's API server, or the in-process
    loop (which is its own client too)."""
    per = level["cpu"].get("us_per_token", {})
    return float(per.get("front-end", per.get("front-end+client", math.nan)))


def compare(rows: dict[str, Any], work: Workload, kinds: Sequence[str],
            encodings: Sequence[str] = (HEADLINE_ENCODING,)) -> dict[str, Any]:
    """bridge / in-process for each output kind and encoding, and bridge / vllm-serve: tok/s, TTFT
    p50, and the serving process's CPU per token."""
    bridges = [(w, k, e) for e in encodings for w in ("bridge", "bridge-mux") for k in kinds]
    pairs = [(_label(w, k, e), _label("in-process", k)) for w, k, e in bridges]
    pairs += [(_label(w, k, e), "vllm-serve") for w, k, e in bridges]
    out: dict[str, Any] = {}
    for a, b in pairs:
        if a in rows and b in rows:
            out[f"{a} / {b}"] = {
                str(c): {"tok_s": _ratio(la["tok_s"], lb["tok_s"]),
                         "ttft_p50": _ratio(la["ttft_p50_ms"], lb["ttft_p50_ms"]),
                         "front_cpu": _ratio(_front_cpu(la), _front_cpu(lb))}
                for c in work.concurrency
                for la, lb in [(rows[a]["levels"][str(c)], rows[b]["levels"][str(c)])]}
    return out


def _label(way: str, kind: str, encoding: str = HEADLINE_ENCODING) -> str:
    """A way's row name: the way, then what differs from the headline (cumulative items; patches
    for the bridge ways)."""
    if way == "vllm-serve":
        return way
    tags = [t for t in (kind if kind != "cumulative" else "",
                        encoding if way.startswith("bridge") and encoding != HEADLINE_ENCODING else "") if t]
    return f"{way} [{', '.join(tags)}]" if tags else way


def report(results: dict[str, Any], work: Workload) -> None:
    rows = results["rows"]
    levels = [str(c) for c in work.concurrency]
    print(f"\n{work.max_tokens}-token generations, temperature 0, ignore_eos; engine: {results['engine_args']}, "
          f"VLLM_CPU_NUM_OF_RESERVED_CPU={work.reserved_cpus} (of {len(os.sched_getaffinity(0))} usable cores); "
          f"{work.rounds} measured rounds per level after 1 warm-up (plus one more for each round contended by "
          f"other processes); tok/s: median over rounds; TTFT: over all requests of those rounds\n")
    headers = ["way", "ready s"]
    for c in levels:
        headers += [f"tok/s @{c}", f"TTFT p50 @{c} ms", f"TTFT p90 @{c} ms"]
    table = []
    for name, row in rows.items():
        cells: list[object] = [name, row["ready_s"]]
        for c in levels:
            lv = row["levels"][c]
            cells += [round(lv["tok_s"]), lv["ttft_p50_ms"], lv["ttft_p90_ms"]]
        table.append(cells)
    print_table(headers, table)

    print("\nCPU per generated token (us), measured rounds; 'foreign': CPU used meanwhile by processes not ours\n")
    headers = ["way", "level", "rounds (contended, left out)", "items/request", "client", "front-end", "engine core",
               "all ours", "foreign cores"]
    table = []
    for name, row in rows.items():
        for c in levels:
            cpu = row["levels"][c]["cpu"]
            per = cpu.get("us_per_token", {})
            client = per.get("client", 0.0)
            front = per.get("front-end", per.get("front-end+client", 0.0))
            lv = row["levels"][c]
            table.append([name, c, f"{lv['rounds']} ({lv['contended_rounds']})" + (" SKEWED" if lv["skewed"] else ""),
                          lv["items_per_request"],
                          round(client) if "client" in per else "(in front-end)", round(front),
                          round(per.get("engine core", 0.0)), round(sum(per.values())),
                          round(cpu.get("foreign_cores", 0.0), 2)])
    print_table(headers, table)

    print("\nTTFT p50 (ms) as the client sees it, and inside vLLM's front-end (metrics.first_token_latency: from "
          "the request's arrival in AsyncLLM to its first token there)\n")
    headers = ["way"] + [h for c in levels for h in (f"client @{c}", f"in vLLM @{c}")]
    table = []
    for name, row in rows.items():
        cells = [name]
        for c in levels:
            lv = row["levels"][c]
            cells += [lv["ttft_p50_ms"], "n/a" if lv["engine_ttft_p50_ms"] is None else lv["engine_ttft_p50_ms"]]
        table.append(cells)
    print_table(headers, table)

    if results["ratios"]:
        print("\nRatios within this run: tok/s, TTFT p50 and the serving process's CPU per token (worker / in-process "
              "loop or vllm serve's API server)\n")
        headers = ["ratio"] + [h for c in levels for h in (f"tok/s @{c}", f"TTFT @{c}", f"CPU @{c}")]
        print_table(headers, [[name] + [f"{v[k]:.2f}" for c in levels for v in [by_level[c]]
                                        for k in ("tok_s", "ttft_p50", "front_cpu")]
                              for name, by_level in results["ratios"].items()])
    used = [lv for row in rows.values() for lv in row["levels"].values()]
    if any(lv["skewed"] for lv in used):
        print(f"\nWARNING: other processes kept using more than {CONTENDED_CORES} of the {psutil.cpu_count()} "
              f"cores through most rounds of some levels: those figures are skewed by a busy machine; rerun "
              f"when it is quiet.")


# -------------------------------------------------------------------------------------------- main

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.bench_engine", description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[8, 32, 64, 256])
    p.add_argument("--rounds", type=int, default=6, help="measured rounds per level, after one warm-up")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=16, help="engine batch limit, the same for all ways")
    p.add_argument("--logprobs", type=int, default=0,
                   help="ask every way for this many top logprobs per token (0: none)")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="vLLM engine arg for all ways: stream an output every N tokens (the first at once)")
    p.add_argument("--bridge-interval-ms", type=int, default=0,
                   help="ask the bridge to coalesce stream items to one per this many ms (0: one per output)")
    p.add_argument("--reserved-cpus", type=int, default=None,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every way: cores the engine's OpenMP threads stay off, "
                        "left to the front-end and the client (default: 1 where the machine has 2 cores or more; "
                        "0: vLLM's default for one engine, OpenMP threads on every core)")
    p.add_argument("--wait-quiet", type=float, default=20.0,
                   help="before each level, wait up to this many seconds for other processes to leave the "
                        "CPU alone (0: do not wait)")
    p.add_argument("--kinds", nargs="+", choices=KINDS, default=["cumulative"],
                   help="RequestOutputKinds to run the bridge and in-process ways with (first: the headline)")
    p.add_argument("--encodings", nargs="+", choices=ENCODINGS, default=[HEADLINE_ENCODING],
                   help="stream encodings to run the bridge ways with (first: the headline; full: every item "
                        "whole, what clients that do not ask for patches get)")
    p.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    p.add_argument("--model", default=None, help="model folder (default: the tiny model, built if missing)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--summarize", nargs="+", metavar="JSON", default=None,
                   help="measure nothing: print the goal figures (median, and each run) of earlier runs' --json files")
    p.add_argument("--logs", default=None, help="keep the servers' logs in this folder")
    p.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase-out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--phase-workload", default=None, help=argparse.SUPPRESS)
    return p


# The figures of issue 18, each a ratio within one run: (row, ratio name in results["ratios"], key).
GOALS = (
    ("worker CPU per token / vllm serve's API server", "bridge-mux / vllm-serve", "front_cpu", "<= 0.5"),
    ("  the same, Stream per request", "bridge / vllm-serve", "front_cpu", ""),
    ("bridge-mux tok/s / in-process", "bridge-mux / in-process", "tok_s", ">= 0.95 (1.0 reserved core)"),
    ("bridge (Stream per request) tok/s / in-process", "bridge / in-process", "tok_s", ">= 0.9 @32"),
    ("TTFT p50 bridge-mux / in-process", "bridge-mux / in-process", "ttft_p50", "<= 1.1 @8"),
    ("bridge-mux tok/s / vllm serve", "bridge-mux / vllm-serve", "tok_s", ""),
)


def summarize_runs(paths: Sequence[str]) -> int:
    """The goal figures over several runs' JSON: the median at each level, and every run's value (the
    spread). Runs are grouped by reserved cores; each group is one table."""
    groups: dict[int, list[dict[str, Any]]] = {}
    for path in paths:
        data = json.loads(Path(path).read_text())
        groups.setdefault(int(data["workload"].get("reserved_cpus", 0)), []).append(data)
    for reserved, runs in sorted(groups.items()):
        levels = sorted({c for r in runs for c in r["workload"]["concurrency"]}, key=int)
        foreign = [round(lv["cpu"].get("foreign_cores", 0.0), 2) for r in runs for row in r["rows"].values()
                   for lv in row["levels"].values()]
        print(f"\nVLLM_CPU_NUM_OF_RESERVED_CPU={reserved}: {len(runs)} runs; foreign cores per level and way: "
              f"median {statistics.median(foreign) if foreign else 0:.2f}, max {max(foreign, default=0):.2f}\n")
        table = []
        for row, ratio, key, goal in GOALS:
            cells: list[object] = [row, goal]
            for c in levels:
                values = [r["ratios"][ratio][str(c)][key] for r in runs
                          if ratio in r["ratios"] and str(c) in r["ratios"][ratio]]
                cells.append(f"{statistics.median(values):.2f} ({', '.join(f'{v:.2f}' for v in values)})"
                             if values else "-")
            table.append(cells)
        print_table(["figure (median over runs; each run)", "goal"] + [f"@{c}" for c in levels], table)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    args = build_parser().parse_args(argv)
    if args.summarize:
        return summarize_runs(args.summarize)
    if args.phase == "in-process":
        spec = json.loads(args.phase_workload)
        kinds = spec.pop("kinds")
        work = Workload(**{**spec, "concurrency": tuple(spec["concurrency"])})
        Path(args.phase_out).write_text(json.dumps(asyncio.run(in_process_measure(work, kinds))))
        return 0

    if args.model is None:
        from bridge_server.tools.tiny_model import ensure_tiny_model
        args.model = str(ensure_tiny_model())
    cores = len(os.sched_getaffinity(0))
    reserved = args.reserved_cpus if args.reserved_cpus is not None else (1 if cores >= 2 else 0)
    if not 0 <= reserved < cores:
        raise SystemExit(f"--reserved-cpus: expected 0 to {cores - 1} (this machine has {cores} cores), got {reserved}")
    # Every way's engine inherits it: the worker, the in-process phase and vllm serve.
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(reserved)
    work = Workload(model=args.model, concurrency=tuple(args.concurrency), rounds=args.rounds,
                    max_tokens=args.max_tokens, max_num_seqs=args.max_num_seqs,
                    stream_interval=args.stream_interval, wait_quiet_s=args.wait_quiet,
                    bridge_interval_ms=args.bridge_interval_ms, reserved_cpus=reserved, logprobs=args.logprobs)
    kinds = list(dict.fromkeys(args.kinds))
    encodings = list(dict.fromkeys(args.encodings))
    started = time.monotonic()
    raw: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        log_dir = Path(args.logs) if args.logs else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        log_dir.mkdir(parents=True, exist_ok=True)
        for way in WAYS:
            if way not in args.ways:
                continue
            t = time.monotonic()
            print(f"[{way}] starting", file=sys.stderr, flush=True)
            if way in ("bridge", "bridge-mux"):
                transports = [w for w in ("bridge", "bridge-mux") if w in args.ways]
                if way != transports[0]:
                    continue   # measured with the first, on the same worker
                raw.update(run_bridge(work, kinds, log_dir, transports, encodings))
            elif way == "in-process":
                for kind, data in run_in_process(work, kinds, log_dir).items():
                    raw[_label(way, kind)] = data
            else:
                raw[way] = run_vllm_serve(work, log_dir)
            print(f"[{way}] done in {time.monotonic() - t:.1f} s", file=sys.stderr, flush=True)
    rows = {name: {"ready_s": data["ready_s"],
                   "levels": {str(c): summarize(data, c) for c in work.concurrency}} for name, data in raw.items()}
    results = {"benchmark": "engine", "machine": machine_info(), "workload": asdict(work), "kinds": kinds,
               "engine_args": work.engine_args(), "sampling": work.sampling(), "rows": rows,
               "encodings": encodings, "ratios": compare(rows, work, kinds, encodings), "total_s": time.monotonic() - started}
    report(results, work)
    print(f"\ntotal {results['total_s']:.0f} s")
    if args.json:
        write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
