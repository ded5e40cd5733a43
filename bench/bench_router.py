"""What the router adds to a call: the same trivial call through the pool server and straight to one
of its workers, in the same run (issue 4).

`python -m bench.bench_router [--json PATH]`

A real `vllm-bridge serve` runs one pool of 2 workers (no engine). Both sides send the same
pre-encoded `CallRequest` of `vllm.distributed.divide(6, 3)` with the same metadata (session, pool)
from sync gRPC channels, as raw bytes (no client-side encode/decode to blur the difference):

- direct  to the worker's own unix socket (the worker the benchmark session is pinned to);
- router  to the pool server, listening on a unix socket too, so that both sides use the same
          transport and the difference is the router hop (metadata routing, slot accounting,
          forwarding, metrics);
- router, asyncio loop: a second pool server, the same but with `--loop asyncio` instead of the
          default uvloop (what the choice of loop is worth, bridge_server/wire/eventloop.py);
- two floors (latency only), each a forwarder with no logic at all, run as its own process on
  the router's event loop (`--bare-proxy LISTEN UPSTREAM`):
  - bare gRPC proxy: bytes in, the same gRPC call to the same worker, bytes out: what a router that
    re-issues each call over gRPC pays for the hop (why the router does not);
  - bare lane proxy: bytes in, the call over the worker's lane (`bridge_server/pool/lane.py`, as the
    router sends it), bytes out: the floor of the router's own design, which splits its cost into
    "the hop" and "our logic" (routing, slots, deadlines, metrics).

Latency: sequential calls in interleaved rounds (direct, router, direct, ...) after a warm-up; p50
and p99 over all rounds. CPU per call: the CPU time of the process in the middle (pool server,
proxy) over the latency phase, divided by the calls it served. Throughput: a closed loop of 64
concurrent callers (threads) for each side: through the router each caller has its own session (so
sessions spread over the 2 workers); direct, callers alternate between the 2 workers. Goal: the
router adds at most 30 % to p50.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc
import psutil

from bench.common import (
    ROOT,
    compare,
    exit_on_sigterm,
    interleaved_latencies,
    interleaved_throughput,
    machine_info,
    print_table,
    write_json,
)
from bridge_server.client.client import BridgeClient
from bridge_server.pool.lane import open_lane
from bridge_server.pool.workerproc import lane_path
from bridge_server.wire import eventloop
from bridge_server.wire.options import MD_POOL, MD_SESSION
from bridge_server.wire.protocol import GRPC_OPTIONS
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import pool_pb2 as ppb
from vllm_bridge.v1 import pool_pb2_grpc as ppb_grpc

TARGET = "vllm.distributed.divide"
ARGS = (6, 3)
GOAL_P50_OVERHEAD = 0.30
CALL = "/vllm_bridge.v1.Bridge/Call"
DIRECT, ROUTER = "direct (worker)", "router (pool server)"
BARE_GRPC, BARE_LANE = "bare gRPC proxy", "bare lane proxy"
ROUTER_MUX = "router, Multiplex"

CONFIG = """
grace_s = 5
[[pools]]
name = "bench"
workers = 2
max_concurrent = 64
queue_size = 4096
"""


async def _bare_proxy(listen: str, upstream: str) -> None:
    """`upstream` is a worker's gRPC address, or `lane:PATH` for its lane."""
    if upstream.startswith("lane:"):
        lane = await open_lane(upstream.removeprefix("lane:"))

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            event = await lane.start(request, context.invocation_metadata() or ()).next()
            reply: bytes = pb.CallReplyView(value=event.value).SerializeToString()
            return reply
    else:
        channel = grpc.aio.insecure_channel(upstream, options=GRPC_OPTIONS)
        forward = channel.unary_unary(CALL)

        async def call(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            md = [(k, v) for k, v in context.invocation_metadata() or () if k != "user-agent"]
            reply: bytes = await forward(request, metadata=md)
            return reply

    server = grpc.aio.server(options=GRPC_OPTIONS)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        "vllm_bridge.v1.Bridge", {"Call": grpc.unary_unary_rpc_method_handler(call)})])
    server.add_insecure_port(listen)
    await server.start()
    await server.wait_for_termination()


def start_bare_proxy(listen: str, upstream: str, loop: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-m", "bench.bench_router", "--bare-proxy", listen, upstream,
                             "--loop", loop], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    path = listen.removeprefix("unix:")
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the bare proxy did not start")
        time.sleep(0.05)
    return proc


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_router", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="latency rounds per side (default %(default)s)")
    p.add_argument("--per-round", type=int, default=300, help="sequential calls per side per round")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls per side before timing")
    p.add_argument("--concurrency", type=int, default=64, help="callers in the throughput loop")
    p.add_argument("--duration", type=float, default=2.0, help="seconds per side per throughput round")
    p.add_argument("--tp-rounds", type=int, default=3, help="throughput rounds per side")
    p.add_argument("--loop", choices=eventloop.LOOPS, default=eventloop.DEFAULT_LOOP,
                   help="the router's event loop (default %(default)s, the server's default); the comparison "
                        "server runs on the other one")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here as JSON")
    p.add_argument("--bare-proxy", nargs=2, metavar=("LISTEN", "UPSTREAM"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


class PoolServerProcess:
    """`vllm-bridge serve` on a unix socket, in its own process group; stop() is SIGTERM."""

    def __init__(self, tmp: Path, loop: str) -> None:
        tmp.mkdir()
        cfg = tmp / "pools.toml"
        cfg.write_text(CONFIG)
        self.address = f"unix:{tmp / 'router.sock'}"
        ready = tmp / "ready"
        self.log = tmp / "server.log"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bridge_server.cli", "serve", "--config", str(cfg), "--listen", self.address,
             "--loop", loop, "--ready-file", str(ready)],
            cwd=ROOT, stdout=self.log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 180
        while not ready.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"pool server did not start:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.1)

    def status(self) -> ppb.StatusReply:
        with grpc.insecure_channel(self.address) as ch:
            reply: ppb.StatusReply = ppb_grpc.PoolStub(ch).Status(ppb.StatusRequest(), timeout=10)
            return reply

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="vllm-bridge-bench-router-"))
    other_loop = next(name for name in eventloop.LOOPS if name != args.loop)
    other_side = f"router, {other_loop} loop"
    server = PoolServerProcess(tmp / "router", args.loop)
    servers = [server]
    bares: list[subprocess.Popen[bytes]] = []
    bare_channels: dict[str, grpc.Channel] = {}
    try:
        with BridgeClient(server.address) as client:
            request, _ = client.request(TARGET, ARGS)
        payload: bytes = request.SerializeToString()
        metadata = ((MD_SESSION, "bench"), (MD_POOL, "bench"))
        routed = grpc.insecure_channel(server.address, options=GRPC_OPTIONS)
        router_rpc = routed.unary_unary(CALL)
        if pb.CallReply.FromString(router_rpc(payload, metadata=metadata)).value.int != ARGS[0] // ARGS[1]:
            raise AssertionError(f"{TARGET}{ARGS} returned a wrong value through the router")
        other = PoolServerProcess(tmp / "router-other-loop", other_loop)
        servers.append(other)
        routed_other = grpc.insecure_channel(other.address, options=GRPC_OPTIONS)
        other_rpc = routed_other.unary_unary(CALL)
        if pb.CallReply.FromString(other_rpc(payload, metadata=metadata)).value.int != ARGS[0] // ARGS[1]:
            raise AssertionError(f"{TARGET}{ARGS} returned a wrong value through the router ({other_loop})")
        workers = server.status().pools[0].workers
        pinned = next(w for w in workers if w.sessions)      # the worker the "bench" session went to
        channels = {w.id: grpc.insecure_channel(w.address, options=GRPC_OPTIONS) for w in workers}
        direct_rpcs = [channels[pinned.id].unary_unary(CALL)] + [
            ch.unary_unary(CALL) for wid, ch in channels.items() if wid != pinned.id]
        direct_rpc = direct_rpcs[0]
        for name, upstream in ((BARE_GRPC, pinned.address),
                               (BARE_LANE, "lane:" + lane_path(pinned.address.removeprefix("unix:")))):
            address = f"unix:{tmp / ('bare-lane.sock' if name == BARE_LANE else 'bare-grpc.sock')}"
            bares.append(start_bare_proxy(address, upstream, args.loop))
            bare_channels[name] = grpc.insecure_channel(address, options=GRPC_OPTIONS)
        sides = {DIRECT: lambda: direct_rpc(payload, metadata=metadata),
                 ROUTER: lambda: router_rpc(payload, metadata=metadata),
                 other_side: lambda: other_rpc(payload, metadata=metadata)}
        for name, ch in bare_channels.items():
            sides[name] = (lambda rpc: lambda: rpc(payload, metadata=metadata))(ch.unary_unary(CALL))
        # The process in the middle of each side, whose CPU time per call is reported.
        middles = {ROUTER: psutil.Process(server.proc.pid), other_side: psutil.Process(other.proc.pid),
                   BARE_GRPC: psutil.Process(bares[0].pid), BARE_LANE: psutil.Process(bares[1].pid)}
        cpu_before = {name: sum(proc.cpu_times()[:2]) for name, proc in middles.items()}
        lat = interleaved_latencies(sides, rounds=args.rounds, per_round=args.per_round, warmup=args.warmup)
        served = args.warmup + args.rounds * args.per_round
        cpu_us = {name: (sum(proc.cpu_times()[:2]) - cpu_before[name]) / served * 1e6
                  for name, proc in middles.items()}
        for ch in bare_channels.values():
            ch.close()
        for proc in bares:
            proc.kill()

        # Throughput: each caller thread gets its own session (router) or worker (direct).
        local = threading.local()
        counter = iter(range(1 << 30))
        lock = threading.Lock()

        def caller_index() -> int:
            i = getattr(local, "i", None)
            if i is None:
                with lock:
                    i = local.i = next(counter)
                local.md = ((MD_SESSION, f"bench-{i}"), (MD_POOL, "bench"))
            return int(i)

        def direct_many() -> object:
            return direct_rpcs[caller_index() % len(direct_rpcs)](payload, metadata=metadata)

        def router_many() -> object:
            caller_index()
            return router_rpc(payload, metadata=local.md)

        def other_many() -> object:
            caller_index()
            return other_rpc(payload, metadata=local.md)

        # The same calls over one Multiplex stream through the router (each caller its own session):
        # what a client that multiplexes gets, from the Python client (which encodes and decodes).
        mux_client = BridgeClient(server.address)
        mux = mux_client.multiplex()

        def router_mux_many() -> object:
            i = caller_index()
            return mux.call(TARGET, *ARGS, session_id=f"bench-{i}", pool="bench")

        tput = interleaved_throughput({DIRECT: direct_many, ROUTER: router_many, other_side: other_many,
                                       ROUTER_MUX: router_mux_many},
                                      rounds=args.tp_rounds, concurrency=args.concurrency,
                                      duration_s=args.duration)
        mux.close()
        mux_client.close()
        per_worker = {w.id: w.calls for w in server.status().pools[0].workers}
        routed.close()
        routed_other.close()
        for ch in channels.values():
            ch.close()
    finally:
        for proc in bares:
            if proc.poll() is None:
                proc.kill()
        for srv in servers:
            srv.stop()

    stats, tput_median, ratio = compare(lat, tput, ROUTER, DIRECT)
    _, _, ratio_other = compare(lat, tput, other_side, DIRECT)
    ratio_p50 = ratio["p50"]
    return {
        "benchmark": "router",
        "machine": machine_info(),
        "payload_bytes": len(payload),
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "latency_us": {name: s.as_dict() for name, s in stats.items()},
        "ratio": {
            **ratio,
            "throughput": tput_median[ROUTER] / tput_median[DIRECT],
            "throughput_multiplex": tput_median[ROUTER_MUX] / tput_median[DIRECT],
            "p50_other_loop": ratio_other["p50"],
            "p99_other_loop": ratio_other["p99"],
            "throughput_other_loop": tput_median[other_side] / tput_median[DIRECT],
            "p50_bare_grpc_proxy": stats[BARE_GRPC].p50_us / stats[DIRECT].p50_us,
            "p50_bare_lane_proxy": stats[BARE_LANE].p50_us / stats[DIRECT].p50_us,
        },
        "other_loop": other_loop,
        "other_side": other_side,
        "router_added_p50_us": stats[ROUTER].p50_us - stats[DIRECT].p50_us,
        "hop_floor_p50_us": stats[BARE_LANE].p50_us - stats[DIRECT].p50_us,
        "router_logic_p50_us": stats[ROUTER].p50_us - stats[BARE_LANE].p50_us,
        "cpu_us_per_call": cpu_us,
        "throughput_ops_s": {name: {"median": tput_median[name], "rounds": v} for name, v in tput.items()},
        "router_calls_per_worker": per_worker,
        "goal": {"p50_overhead_max": GOAL_P50_OVERHEAD, "met": ratio_p50 <= 1 + GOAL_P50_OVERHEAD},
    }


def report(res: dict[str, Any]) -> None:
    lat, tput, ratio = res["latency_us"], res["throughput_ops_s"], res["ratio"]
    p = res["params"]
    print(f"\n{TARGET}{ARGS}, {res['payload_bytes']} bytes, through the router vs straight to the worker "
          f"({p['rounds']} interleaved rounds x {p['per_round']} calls per side; throughput: {p['concurrency']} "
          f"callers over 2 workers, median of {p['tp_rounds']} x {p['duration']:g} s)")
    cpu = res["cpu_us_per_call"]
    rows = [[name, lat[name]["p50_us"], lat[name]["p99_us"], lat[name]["mean_us"],
             tput[name]["median"] if name in tput else "-", cpu[name] if name in cpu else "-"] for name in lat]
    rows += [[name, "-", "-", "-", tput[name]["median"], "-"] for name in tput if name not in lat]
    print_table(["side", "p50 us", "p99 us", "mean us", f"ops/s @{p['concurrency']}", "middle CPU us/call"], rows)
    rr = ratio["p50_per_round"]
    print(f"\nrouter/direct: p50 {ratio['p50']:.2f}x (+{res['router_added_p50_us']:.0f} us; per round: median "
          f"{ratio['p50_per_round_median']:.2f}x, range {min(rr):.2f}-{max(rr):.2f}x), p99 {ratio['p99']:.2f}x, "
          f"throughput {ratio['throughput']:.2f}x")
    print(f"of the router's +{res['router_added_p50_us']:.0f} us at p50: the lane hop with no logic costs "
          f"+{res['hop_floor_p50_us']:.0f} us ({ratio['p50_bare_lane_proxy']:.2f}x direct), the router's own work "
          f"{res['router_logic_p50_us']:+.0f} us; a bare gRPC hop instead of the lane: "
          f"{ratio['p50_bare_grpc_proxy']:.2f}x direct")
    print(f"the router on {res['other_loop']}'s loop instead of {p['loop']}'s: "
          f"p50 {ratio['p50_other_loop']:.2f}x direct, p99 {ratio['p99_other_loop']:.2f}x, "
          f"throughput {ratio['throughput_other_loop']:.2f}x; router CPU per call "
          f"{cpu[res['other_side']] - cpu[ROUTER]:+.0f} us")
    print(f"throughput over one Multiplex stream through the router: {ratio['throughput_multiplex']:.2f}x direct")
    print(f"calls per worker through the router: {res['router_calls_per_worker']}")
    goal = res["goal"]
    print(f"goal: router adds <= {goal['p50_overhead_max']:.0%} to p50: {'met' if goal['met'] else 'NOT met'}")


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    args = parse_args(argv)
    if args.bare_proxy:
        eventloop.run(_bare_proxy(*args.bare_proxy), args.loop)
        return 0
    res = run(args)
    report(res)
    if args.json:
        write_json(args.json, res)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
