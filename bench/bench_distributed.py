"""A 2-rank all-reduce through the bridge against the same all-reduce run directly by two torch
processes, in the same run (issue 5).

`python -m bench.bench_distributed [--json PATH] [--rounds N]`

- direct: two plain Python processes join a gloo group (torch.distributed) and time
  `dist.all_reduce` of the tensor on rank 0, after a warm-up; what the collective itself costs.
- bridge, by value: `vllm-bridge serve` with a distributed pool of 2 gloo ranks; the client sends a
  `Collective` of `vllm.distributed.tensor_model_parallel_all_reduce` with one tensor per rank (by
  value) and gets both reduced tensors back (by value: the workers' tensor limit is raised above the
  size). The figure includes moving every tensor in and out through two gRPC hops.
- bridge, by ref: the same collective on tensors that stay on the ranks (refs; results come back as
  refs too, the pool's tensor limit being 0): how a distributed model is driven, where the data
  lives on the ranks and the client only orchestrates. The figure is the bridge's control cost.

Sizes: 1 MiB and 64 MiB of float32. Reports the median latency of each side and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import ROOT, exit_on_sigterm, free_port, machine_info, print_table, wait_healthy, write_json

SIZES = {"1 MiB": 1 << 20, "64 MiB": 64 << 20}

_DIRECT = r"""
import statistics, sys, time, torch, torch.distributed as dist
rank, port, numel, rounds = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
t = torch.ones(numel) * (rank + 1)
for _ in range(2):
    dist.all_reduce(t.clone())
samples = []
for _ in range(rounds):
    x = t.clone()
    dist.barrier()
    start = time.perf_counter()
    dist.all_reduce(x)
    samples.append(time.perf_counter() - start)
if rank == 0:
    print(statistics.median(samples))
dist.destroy_process_group()
"""

CONFIG = """
[[pools]]
name = "by_value"
workers = 2
worker_args = ["--tensor-max-bytes", "268435456"]
[pools.distributed]
backend = "gloo"
tensor_parallel_size = 2

[[pools]]
name = "by_ref"
workers = 2
worker_args = ["--tensor-max-bytes", "0"]
[pools.distributed]
backend = "gloo"
tensor_parallel_size = 2
"""
ALL_REDUCE = "vllm.distributed.tensor_model_parallel_all_reduce"


def direct(numel: int, rounds: int) -> float:
    port = free_port()
    procs = [subprocess.Popen([sys.executable, "-c", _DIRECT, str(r), str(port), str(numel), str(rounds)],
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return float(out[0].strip().splitlines()[-1])   # gloo prints a connection line first


def by_value(client: Any, numel: int, rounds: int) -> float:
    per_rank: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((torch.ones(numel) * (r + 1),), {}) for r in (0, 1)]
    for _ in range(2):
        client.collective(ALL_REDUCE, per_rank=per_rank, timeout=120)
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = client.collective(ALL_REDUCE, per_rank=per_rank, timeout=120)
        samples.append(time.perf_counter() - start)
    assert float(out[0][0]) == 3.0 and float(out[1][-1]) == 3.0
    return statistics.median(samples)


def by_ref(client: Any, numel: int, rounds: int) -> float:
    # Put one tensor on each rank (its result comes back as a ref: the pool's tensor limit is 0).
    held = client.collective(ALL_REDUCE, per_rank=[((torch.zeros(numel),), {}) for _ in (0, 1)], timeout=120)
    per_rank: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((ref,), {}) for ref in held]
    for _ in range(2):
        client.release(*client.collective(ALL_REDUCE, per_rank=per_rank, timeout=120))
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        out = client.collective(ALL_REDUCE, per_rank=per_rank, timeout=120)
        samples.append(time.perf_counter() - start)
        client.release(*out)
    client.release(*held)
    return statistics.median(samples)


def run(rounds: int) -> dict[str, Any]:
    from bridge_server.client.client import BridgeClient
    from bridge_server.wire.options import RuntimeOptions

    tmp = Path(tempfile.mkdtemp(prefix="vllm-bridge-bench-dist-"))
    cfg = tmp / "pools.toml"
    cfg.write_text(CONFIG)
    address = f"127.0.0.1:{free_port()}"
    log = tmp / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "bridge_server.cli", "serve", "--config", str(cfg), "--listen",
                             address], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT,
                            start_new_session=True)
    results: dict[str, Any] = {"machine": machine_info(), "rounds": rounds, "sizes": {}}
    try:
        wait_healthy(address, proc, log, timeout=180)
        with BridgeClient(address, options=RuntimeOptions(pool="by_value")) as value_client, \
                BridgeClient(address, options=RuntimeOptions(pool="by_ref")) as ref_client:
            for label, nbytes in SIZES.items():
                numel = nbytes // 4
                d = direct(numel, rounds)
                v = by_value(value_client, numel, rounds)
                r = by_ref(ref_client, numel, rounds)
                results["sizes"][label] = {"direct_s": d, "by_value_s": v, "by_ref_s": r,
                                           "by_value_ratio": v / d, "by_ref_ratio": r / d}
    finally:
        proc.terminate()
        proc.wait(60)
    return results


def report(res: dict[str, Any]) -> None:
    rows = [(label, f"{r['direct_s'] * 1e3:.2f}", f"{r['by_ref_s'] * 1e3:.2f}", f"{r['by_ref_ratio']:.2f}x",
             f"{r['by_value_s'] * 1e3:.2f}", f"{r['by_value_ratio']:.2f}x") for label, r in res["sizes"].items()]
    print_table(["all_reduce, 2 ranks", "direct ms", "bridge by ref ms", "ratio", "bridge by value ms", "ratio"],
                rows)
    print("medians; by ref: the tensors stay on the ranks; by value: they cross two gRPC hops each way")


def main(argv: Sequence[str] | None = None) -> int:
    exit_on_sigterm()
    p = argparse.ArgumentParser(prog="python -m bench.bench_distributed", description=__doc__)
    p.add_argument("--rounds", type=int, default=20)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = run(args.rounds)
    report(res)
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
