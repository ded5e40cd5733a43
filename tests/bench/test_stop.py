"""The benchmarks start real servers in sessions of their own; a SIGTERM to `python -m bench` must
stop them too, or a stopped benchmark leaves a worker (and, for the engine, its engine core) behind
to skew every later figure on the machine."""

from __future__ import annotations

import signal
import subprocess
import sys

import psutil

from tests.conftest import ROOT
from tests.pool.harness import wait_until


def _workers(top: psutil.Process) -> list[psutil.Process]:
    return [p for p in top.children(recursive=True) if "bridge_server.cli" in " ".join(p.cmdline())]


def test_sigterm_to_a_benchmark_stops_the_servers_it_started() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "bench", "worker", "--rounds", "1000", "--duration", "60"],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        top = psutil.Process(proc.pid)
        wait_until(lambda: bool(_workers(top)), timeout=120, what="the benchmark's worker started")
        started = top.children(recursive=True)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
        gone, alive = psutil.wait_procs(started, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        if proc.poll() is None:
            proc.kill()
