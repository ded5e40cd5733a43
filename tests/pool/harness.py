"""Helpers for the pool tests: a real `vllm-bridge serve` process, real slow calls, process checks.

Not a test module: imported by tests/test_pool_*.py.
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from bridge_server.client.client import BridgeClient, CallError
from bridge_server.wire.security import channel, token_metadata
from tests.conftest import ROOT, free_port
from vllm_bridge.v1 import pool_pb2 as ppb
from vllm_bridge.v1 import pool_pb2_grpc as ppb_grpc

GATE_TARGET = "vllm.distributed.stateless_init_torch_distributed_process_group"


@dataclass
class PoolServer:
    proc: subprocess.Popen[bytes]
    address: str
    log: Path
    metrics_port: int
    credentials: dict[str, Any] = field(default_factory=dict)   # what its clients need: token, tls_ca, ...

    def status(self, pool: str = "") -> ppb.StatusReply:
        c = self.credentials
        with channel(self.address, [], c.get("tls_ca"), c.get("tls_cert"), c.get("tls_key")) as ch:
            reply: ppb.StatusReply = ppb_grpc.PoolStub(ch).Status(ppb.StatusRequest(pool=pool), timeout=5,
                                                                  metadata=token_metadata(c.get("token")))
            return reply

    def pool(self, name: str) -> ppb.PoolStatus:
        return self.status(name).pools[0]

    def client(self, **options: Any) -> BridgeClient:
        from bridge_server.wire.options import RuntimeOptions
        return BridgeClient(self.address, options=RuntimeOptions(**options), **self.credentials)

    def stop(self, timeout: float = 30) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()     # workers die with it (PR_SET_PDEATHSIG)
                self.proc.wait(5)

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")[-6000:]


def start_pool_server(tmp: Path, config: str, *extra: str, metrics: bool = False, timeout: float = 180,
                      **credentials: Any) -> PoolServer:
    """Writes `config` (TOML) and runs `vllm-bridge serve` on it; returns once every pool is up.
    `credentials` are what its clients need (token, tls_ca, tls_cert, tls_key). Each pool lets one
    rank join a client's process group from outside (`Gate`'s peer: the tests' slow call), unless
    the config sets outside_ranks itself."""
    if "outside_ranks" not in config:
        config = config.replace("[[pools]]\n", "[[pools]]\noutside_ranks = 1\n")
    cfg = tmp / "pools.toml"
    cfg.write_text(config)
    address = f"127.0.0.1:{free_port()}"
    metrics_port = free_port() if metrics else 0
    ready = tmp / "ready"
    log = tmp / "server.log"
    proc = subprocess.Popen([sys.executable, "-m", "bridge_server.cli", "serve", "--config", str(cfg), "--listen", address,
                             "--ready-file", str(ready), "--metrics-port", str(metrics_port), *extra],
                            cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)
    server = PoolServer(proc, address, log, metrics_port, credentials)
    deadline = time.monotonic() + timeout
    while not ready.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{server.log_text()}")
        if time.monotonic() > deadline:
            server.stop()
            raise TimeoutError(f"server not ready after {timeout} s:\n{server.log_text()}")
        time.sleep(0.1)
    return server


def wait_until(predicate: Callable[[], bool], timeout: float = 30, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        time.sleep(0.05)


def _gate_port() -> int:
    """A free port below the ephemeral range. A port `free_port` finds is one the kernel hands out for
    outgoing connections too, and between this process closing it and the worker binding it, one of
    the suite's many gRPC connections could take it: the gate then failed at once and freed the
    worker it was meant to hold. Ports below the range are only ever bound on purpose."""
    low = 20_000
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = min(low, int(f.read().split()[0]) - 2_000)
    except (OSError, ValueError, IndexError):
        pass
    for _ in range(200):
        port = random.randrange(max(low - 8_000, 1_024), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    return free_port()


@dataclass
class Gate:
    """A real slow call: rank 0 of a 2-rank gloo group blocks in the worker until `open()` joins as
    rank 1 from this process. It runs in the worker's shared thread pool, like any blocking call."""

    port: int = field(default_factory=_gate_port)
    # The peer's group is kept alive: dropping it closes its sockets, which can fail rank 0's
    # connection set-up in the worker when it has not finished yet.
    peers: list[Any] = field(default_factory=list)

    def args(self) -> tuple[Any, ...]:
        return (GATE_TARGET, "127.0.0.1", self.port, 0, 2, "gloo")

    def running(self) -> bool:
        """Rank 0 has started in the worker: its store listens on the port."""
        return any(c.laddr and c.laddr.port == self.port and c.status == psutil.CONN_LISTEN
                   for c in psutil.net_connections(kind="tcp"))

    def open(self) -> threading.Thread:
        def peer() -> None:
            from vllm.distributed import stateless_init_torch_distributed_process_group
            self.peers.append(
                stateless_init_torch_distributed_process_group("127.0.0.1", self.port, 1, 2, "gloo"))
        t = threading.Thread(target=peer, daemon=True)
        t.start()
        return t


@dataclass
class Outcome:
    """What a call made in a background thread came to, and when."""

    value: Any = None
    error: CallError | None = None
    ended: float = 0.0
    done: threading.Event = field(default_factory=threading.Event)


def in_thread(fn: Callable[[], Any]) -> Outcome:
    out = Outcome()

    def run() -> None:
        try:
            out.value = fn()
        except CallError as err:
            out.error = err
        finally:
            out.ended = time.monotonic()
            out.done.set()
    threading.Thread(target=run, daemon=True).start()
    return out


def open_gates(gates: Iterable[Gate], timeout: float = 60) -> None:
    for t in [g.open() for g in gates]:
        t.join(timeout)


def group_members(pgid: int) -> list[psutil.Process]:
    """Live processes of a process group (zombies count as gone)."""
    out = []
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (ProcessLookupError, psutil.Error):
            pass
    return out


def toml_inline(table: dict[str, object]) -> str:
    """A TOML inline table (JSON's strings, numbers and booleans read the same in TOML)."""
    return "{ " + ", ".join(f"{k} = {toml_inline(v) if isinstance(v, dict) else json.dumps(v)}"
                            for k, v in table.items()) + " }"


@contextmanager
def others_calling(server: PoolServer, pool: str) -> Iterator[list[float]]:
    """Another client calling `divide(6, 3)` over and over meanwhile: the latencies it saw, to show
    that what runs inside the block holds up nobody else."""
    slowest: list[float] = []
    stop = threading.Event()

    def others() -> None:
        with server.client(pool=pool) as c:
            while not stop.is_set():
                t0 = time.monotonic()
                c.call("vllm.distributed.divide", 6, 3, timeout=10)
                slowest.append(time.monotonic() - t0)

    background = threading.Thread(target=others)
    background.start()
    try:
        yield slowest
    finally:
        stop.set()
        background.join(10)
