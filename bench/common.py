"""Helpers shared by the benchmarks: real server processes, timing loops, statistics, tables.

Every benchmark here compares the bridge against a baseline measured *in the same run*, because the
machines we run on are small (2 cores) and shared: an absolute figure from one run says little, a
ratio against a baseline that suffered the same noise says a lot. The helpers below are built for
that: servers run as real processes over real sockets (as a user starts them), measurements are
interleaved in rounds (A, B, A, B, ...) so that drift hits every side, and warm-up calls are made
before anything is timed.

`python -m bench.common echo --listen HOST:PORT` runs the plain gRPC echo server used as the "what
gRPC itself costs" baseline (see `start_echo_server`).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

ROOT = Path(__file__).resolve().parents[1]

# The echo server's one method. Bytes in, the same bytes out: no protobuf, no codec, no Python work
# beyond what grpc.aio itself does per call.
ECHO_SERVICE = "bench.Echo"
ECHO_METHOD = f"/{ECHO_SERVICE}/Echo"

# The same environment the tests and the CLI give vLLM: no hub, no telemetry, a small KV cache.
_ENV_DEFAULTS = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1",
                 "DO_NOT_TRACK": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

Call = Callable[[], object]


# ------------------------------------------------------------------------------------- processes

def exit_on_sigterm() -> None:
    """SIGTERM ends a benchmark as Ctrl-C does: by an exception in the main thread, so its `finally`
    blocks stop the servers it started. Python's own SIGTERM ends the process on the spot, and those
    servers, each in a session of its own, would outlive it (a worker and its engine core)."""
    def _exit(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)
    signal.signal(signal.SIGTERM, _exit)


def free_port() -> int:
    """A port that was free a moment ago (the server binds it with so_reuseport off, so a clash fails
    loudly instead of two servers silently sharing it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ServerProcess:
    """A server started by `start_server`; stop it (or use it as a context manager) to kill its group."""

    proc: subprocess.Popen[bytes]
    address: str
    log: Path

    def stop(self) -> None:
        """SIGTERM to the whole process group (a worker may have children), SIGKILL if it lingers."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def wait_healthy(address: str, proc: subprocess.Popen[bytes] | None = None, log: Path | None = None,
                 timeout: float = 120.0) -> None:
    """Polls the standard health service until the server says SERVING.

    A worker answers (NOT_SERVING) before its catalog and published objects are ready, so "the port
    accepts connections" is not enough; a process that dies meanwhile fails at once, with its log.
    """
    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"{address}: process exited with {proc.returncode}:\n"
                                   f"{log.read_text() if log else ''}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.1)
    raise TimeoutError(f"{address} not healthy after {timeout} s:\n{log.read_text() if log else ''}")


def start_server(argv: Sequence[str], *, name: str, port: int | None = None,
                 log_dir: Path | None = None, timeout: float = 120.0) -> ServerProcess:
    """Starts `sys.executable -m <argv...> --listen 127.0.0.1:PORT` in its own process group and waits
    until it is healthy. The log goes to a file, so a failure to start can be shown in full."""
    port = port or free_port()
    address = f"127.0.0.1:{port}"
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="vllm-bridge-bench-"))
    log = log_dir / f"{name}-{port}.log"
    env = {**_ENV_DEFAULTS, **os.environ}
    proc = subprocess.Popen([sys.executable, "-m", *argv, "--listen", address], cwd=ROOT, env=env,
                            stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(address, proc, log, timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)
        raise
    return ServerProcess(proc, address, log)


def start_worker(*extra: str, log_dir: Path | None = None) -> ServerProcess:
    """A real worker, started the way a user or supervisor starts one (`vllm-bridge worker`)."""
    return start_server(["bridge_server.cli", "worker", *extra], name="worker", log_dir=log_dir)


def start_echo_server(log_dir: Path | None = None) -> ServerProcess:
    """The baseline server: grpc.aio like the worker, in its own process like the worker, but its one
    method returns the request bytes untouched."""
    return start_server(["bench.common", "echo"], name="echo", log_dir=log_dir, timeout=30.0)


async def serve_echo(listen: str) -> None:
    """Runs the echo server (with the standard health service, so `wait_healthy` works) until SIGTERM."""
    from grpc_health.v1 import health

    from bridge_server.wire.protocol import GRPC_OPTIONS

    async def echo(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        return request

    server = grpc.aio.server(options=GRPC_OPTIONS)
    # No request_deserializer / response_serializer: the handler sees and returns raw bytes.
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(
        ECHO_SERVICE, {"Echo": grpc.unary_unary_rpc_method_handler(echo)}),))
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if server.add_insecure_port(listen) == 0:
        raise OSError(f"cannot listen on {listen}")
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(0)


def echo_call(channel: grpc.Channel) -> Callable[..., bytes]:
    """A sync callable for the echo method on `channel`: bytes in, bytes out (no serializers)."""
    return channel.unary_unary(ECHO_METHOD)  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ statistics

def percentile(sorted_samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by linear interpolation between closest ranks (numpy's default),
    so p50 of an even count is the mean of the two middle samples."""
    if not sorted_samples:
        return math.nan
    pos = (len(sorted_samples) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_samples) - 1)
    return sorted_samples[lo] + (sorted_samples[hi] - sorted_samples[lo]) * (pos - lo)


@dataclass(frozen=True)
class LatencyStats:
    """Latency summary in microseconds: what the README and the JSON report."""

    n: int
    p50_us: float
    p99_us: float
    mean_us: float

    def as_dict(self) -> dict[str, float]:
        return asdict(self)


def latency_stats(samples_ns: Sequence[int]) -> LatencyStats:
    """p50, p99 and mean of latency samples given in nanoseconds (as `time_calls` returns them)."""
    s = sorted(samples_ns)
    mean = sum(s) / len(s) if s else math.nan
    return LatencyStats(len(s), percentile(s, 50) / 1e3, percentile(s, 99) / 1e3, mean / 1e3)


def median(values: Sequence[float]) -> float:
    return percentile(sorted(values), 50)


def compare(lat: Mapping[str, Sequence[Sequence[int]]], tput: Mapping[str, Sequence[float]], side: str,
            baseline: str) -> tuple[dict[str, LatencyStats], dict[str, float], dict[str, Any]]:
    """One side against its same-run baseline: latency stats per side over all rounds, median
    throughput per side, and the ratios every benchmark reports (overall, and round by round, since
    rounds were interleaved precisely so that each one compares like with like)."""
    stats = {name: latency_stats([s for r in rounds for s in r]) for name, rounds in lat.items()}
    round_ratios = [latency_stats(a).p50_us / latency_stats(b).p50_us for a, b in zip(lat[side], lat[baseline])]
    tput_median = {name: median(v) for name, v in tput.items()}
    ratio: dict[str, Any] = {
        "p50": stats[side].p50_us / stats[baseline].p50_us,
        "p99": stats[side].p99_us / stats[baseline].p99_us,
        "p50_per_round": round_ratios,
        "p50_per_round_median": median(round_ratios),
    }
    return stats, tput_median, ratio


# ------------------------------------------------------------------------------------ timing loops

def time_calls(fn: Call, n: int) -> list[int]:
    """Runs `fn` n times back to back and returns each call's latency in nanoseconds.

    Sequential on purpose: one caller, one call in flight, so the figure is the round trip a single
    Elixir process sees, without queueing.
    """
    out = [0] * n
    clock = time.perf_counter_ns
    for i in range(n):
        t0 = clock()
        fn()
        out[i] = clock() - t0
    return out


def closed_loop(fn: Call, concurrency: int, duration_s: float) -> float:
    """Runs `concurrency` threads, each calling `fn` back to back for `duration_s`; returns calls/s.

    A closed loop (each caller waits for its reply before the next call) measures what the server
    sustains at that concurrency, instead of how a queue grows under an open-loop rate. The threads
    start together on a barrier, and only calls that complete inside the window count. The first
    error any caller hits is re-raised: a benchmark that silently counts failures is wrong.
    """
    counts = [0] * concurrency
    errors: list[BaseException] = []
    barrier = threading.Barrier(concurrency + 1)
    window: list[float] = []

    def caller(i: int) -> None:
        barrier.wait()
        end = window[0] + duration_s
        n = 0
        try:
            while True:
                fn()
                if time.perf_counter() >= end:
                    break
                n += 1
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            errors.append(exc)
        counts[i] = n

    threads = [threading.Thread(target=caller, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    window.append(time.perf_counter())
    barrier.wait()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    # Only calls that ended inside the window were counted, so the window is the divisor (the join
    # comes up to one call's latency later).
    return sum(counts) / duration_s


def interleaved_latencies(calls: Mapping[str, Call], *, rounds: int, per_round: int,
                          warmup: int) -> dict[str, list[list[int]]]:
    """Times every call in `calls` in rounds (A, B, A, B, ...): `per_round` sequential calls per side
    per round, after `warmup` untimed calls per side. Returns each side's samples, one list per round,
    so a caller can pool them or compare round by round."""
    for fn in calls.values():
        for _ in range(warmup):
            fn()
    out: dict[str, list[list[int]]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            out[name].append(time_calls(fn, per_round))
    return out


def interleaved_throughput(calls: Mapping[str, Call], *, rounds: int, concurrency: int,
                           duration_s: float, warmup_s: float = 0.5) -> dict[str, list[float]]:
    """Closed-loop throughput of every call in `calls`, in rounds (A, B, A, B, ...), after a short
    warm-up at the same concurrency per side (threads, connections and the server's pools warm)."""
    for fn in calls.values():
        closed_loop(fn, concurrency, warmup_s)
    out: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, fn in calls.items():
            out[name].append(closed_loop(fn, concurrency, duration_s))
    return out


# ---------------------------------------------------------------------------------------- output

def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *, file: Any = None) -> None:
    """Prints an aligned text table; floats get one decimal (microseconds and ops/s need no more)."""
    def cell(v: object) -> str:
        if isinstance(v, float):
            return "nan" if math.isnan(v) else f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return str(v)

    text = [[cell(v) for v in row] for row in rows]
    widths = [max(len(str(h)), *(len(r[i]) for r in text)) for i, h in enumerate(headers)]
    out = file or sys.stdout
    print("  ".join(str(h).ljust(w) for h, w in zip(headers, widths)), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for r in text:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))), file=out)


def machine_info() -> dict[str, Any]:
    """What a figure was measured on: it travels with every JSON result."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
            "grpc": grpc.__version__}


def write_json(path: str | Path, result: Mapping[str, Any]) -> None:
    Path(path).write_text(json.dumps(result, indent=2) + "\n")


def _main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.common", description="benchmark helper servers")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("echo", help="run the plain gRPC echo server (the baseline)")
    p.add_argument("--listen", required=True)
    args = parser.parse_args(argv)
    asyncio.run(serve_echo(args.listen))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
