"""What a trivial call through a worker costs, against what gRPC itself costs (issue 2).

`python -m bench.bench_worker [--json PATH]`

Two servers run as real processes on this machine, both grpc.aio:
- the worker (`vllm-bridge worker`), called with `BridgeClient.call("vllm.distributed.divide", 6, 3)`:
  encode the arguments, send, plan/decode/bind/run inline/encode on the server, decode the reply;
- a plain echo server (`bench.common echo`) whose one method returns the request bytes untouched,
  called from a sync grpc channel with the *same bytes* (the serialized CallRequest of that divide
  call) and the same metadata. That is the floor: what grpc itself costs per call, in Python, here.

A third side, the worker called through its raw stub with the request already encoded, splits the
difference between the two into client-side work (BridgeClient's encode/decode) and server-side work.

Sides are measured in interleaved rounds (A, B, C, A, B, C, ...) after a warm-up, so drift on this
small shared machine hits all of them; the figure that matters is the ratio worker/echo (goal: p50
within 2x). Throughput is a closed loop of 8 concurrent callers (threads sharing one channel).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import grpc

from bench.common import (
    compare,
    echo_call,
    exit_on_sigterm,
    interleaved_latencies,
    interleaved_throughput,
    machine_info,
    print_table,
    start_echo_server,
    start_worker,
    write_json,
)
from bridge_server.client.client import BridgeClient
from bridge_server.wire.protocol import GRPC_OPTIONS

TARGET = "vllm.distributed.divide"
ARGS = (6, 3)
GOAL_P50_RATIO = 2.0

# Side names, in the order they are interleaved and printed.
WORKER = "worker (BridgeClient.call)"
WORKER_RAW = "worker (stub.Call, pre-encoded)"
ECHO = "echo (plain grpc)"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.bench_worker", description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=10, help="latency rounds per side (default %(default)s)")
    p.add_argument("--per-round", type=int, default=300, help="sequential calls per side per round")
    p.add_argument("--warmup", type=int, default=300, help="untimed calls per side before timing")
    p.add_argument("--concurrency", type=int, default=8, help="callers in the throughput loop")
    p.add_argument("--duration", type=float, default=1.0, help="seconds per side per throughput round")
    p.add_argument("--tp-rounds", type=int, default=5, help="throughput rounds per side")
    p.add_argument("--worker", default=None, metavar="ADDRESS",
                   help="measure this running worker instead of starting one")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the results here as JSON")
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    started = []
    try:
        echo = start_echo_server()
        started.append(echo)
        if args.worker:
            worker_address = args.worker
        else:
            worker = start_worker()
            started.append(worker)
            worker_address = worker.address
        with BridgeClient(worker_address) as client, \
                grpc.insecure_channel(echo.address, options=GRPC_OPTIONS) as echo_channel:
            result = client.call(TARGET, *ARGS)
            if result != ARGS[0] // ARGS[1]:
                raise AssertionError(f"{TARGET}{ARGS} returned {result!r}")
            request, refs = client.request(TARGET, ARGS)
            metadata = client._metadata(refs, {})   # what call() sends: x-bridge-session
            payload = request.SerializeToString()
            echo_rpc = echo_call(echo_channel)
            if echo_rpc(payload, metadata=metadata) != payload:
                raise AssertionError("echo server did not echo")
            stub_call = client.stub.Call

            calls = {
                WORKER: lambda: client.call(TARGET, *ARGS),
                WORKER_RAW: lambda: stub_call(request, metadata=metadata),
                ECHO: lambda: echo_rpc(payload, metadata=metadata),
            }
            lat = interleaved_latencies(calls, rounds=args.rounds, per_round=args.per_round, warmup=args.warmup)
            tput = interleaved_throughput(calls, rounds=args.tp_rounds, concurrency=args.concurrency,
                                          duration_s=args.duration)
    finally:
        for server in reversed(started):
            server.stop()

    stats, tput_median, ratio = compare(lat, tput, WORKER, ECHO)
    ratio_p50 = ratio["p50"]
    return {
        "benchmark": "worker",
        "machine": machine_info(),
        "payload_bytes": len(payload),
        "params": {k: v for k, v in vars(args).items() if k != "json"},
        "latency_us": {name: s.as_dict() for name, s in stats.items()},
        "ratio": {
            **ratio,
            "p50_raw_stub": stats[WORKER_RAW].p50_us / stats[ECHO].p50_us,
            "throughput": tput_median[WORKER] / tput_median[ECHO],
        },
        "throughput_ops_s": {name: {"median": tput_median[name], "rounds": v} for name, v in tput.items()},
        "goal": {"p50_ratio_max": GOAL_P50_RATIO, "met": ratio_p50 <= GOAL_P50_RATIO},
    }


def report(res: dict[str, Any]) -> None:
    lat, tput, ratio = res["latency_us"], res["throughput_ops_s"], res["ratio"]
    p = res["params"]
    print(f"\n{TARGET}{ARGS} vs plain grpc echo of the same {res['payload_bytes']} bytes "
          f"({p['rounds']} interleaved rounds x {p['per_round']} calls per side; "
          f"throughput: {p['concurrency']} callers, median of {p['tp_rounds']} x {p['duration']:g} s)")
    rows = [[name, lat[name]["p50_us"], lat[name]["p99_us"], lat[name]["mean_us"], tput[name]["median"]]
            for name in lat]
    print_table(["side", "p50 us", "p99 us", "mean us", f"ops/s @{p['concurrency']}"], rows)
    rr = ratio["p50_per_round"]
    print(f"\nworker/echo: p50 {ratio['p50']:.2f}x (per round: median {ratio['p50_per_round_median']:.2f}x, "
          f"range {min(rr):.2f}-{max(rr):.2f}x), "
          f"p99 {ratio['p99']:.2f}x, throughput {ratio['throughput']:.2f}x; "
          f"pre-encoded stub/echo p50 {ratio['p50_raw_stub']:.2f}x")
    goal = res["goal"]
    print(f"goal p50 <= {goal['p50_ratio_max']:g}x echo: {'met' if goal['met'] else 'NOT met'}")


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    args = parse_args(argv)
    res = run(args)
    report(res)
    if args.json:
        write_json(args.json, res)
        print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
