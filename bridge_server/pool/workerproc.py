"""One worker process: how it is started, when it counts as ready, how it is stopped.

The mechanics only (the supervisor decides when and why). A worker is
`python -m bridge_server.cli worker --listen unix:<dir>/<n>.sock --worker-id <pool>-<index>-g<gen>`,
in its own session and process group, so that killing the group also kills vLLM's engine-core
children, and with PR_SET_PDEATHSIG set to SIGHUP, on which the worker kills its whole group (see
`cli.cmd_worker`): when the server dies, however it dies, its workers and their engine cores go too.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import IO

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.pool.config import PoolConfig
from bridge_server.pool.poolstate import Backend
from bridge_server.wire.protocol import GRPC_OPTIONS

# Workers are spawned through this tiny launcher rather than with a preexec hook: a preexec hook
# forces a plain fork() of this multi-threaded gRPC process (gRPC's fork handlers can abort the
# child), while without one Python uses vfork+exec, which runs no Python code in the child. The
# launcher asks for SIGHUP when its parent (this server) dies, a setting that survives exec, then
# becomes the worker. Not SIGKILL: the worker must live long enough to take its engine cores with it
# (they are its children, and nothing else would kill them once the server is gone).
_LAUNCHER = """\
import ctypes, os, signal, sys
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGHUP), 0, 0, 0)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != int(sys.argv[1]):
    os._exit(70)  # the server died before the prctl took effect
os.execv(sys.executable, [sys.executable] + sys.argv[2:])
"""

# A worker's socket is local: reconnect quickly rather than with gRPC's default backoff (1 s, growing).
CHANNEL_OPTIONS = GRPC_OPTIONS + [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                                  ("grpc.max_reconnect_backoff_ms", 1000)]

STARTING, STOPPING, EXITED = "starting", "stopping", "exited"


def kill_group(pgid: int, sig: int = signal.SIGKILL) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def lane_path(socket_path: str) -> str:
    """Where a supervised worker serves the router's lane: beside its gRPC socket."""
    return socket_path.removesuffix(".sock") + ".lane"


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exited with code {rc}"


@dataclass(eq=False)
class WorkerProc:
    """One worker process, from spawn to exit."""

    id: str
    pool: str
    index: int
    generation: int
    socket_path: str
    proc: asyncio.subprocess.Process | None = None
    state: str = STARTING
    started: float = field(default_factory=time.monotonic)
    backend: Backend | None = None
    expected_exit: bool = False       # we asked it to stop: not a crash
    exit_description: str = ""
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    recycle: asyncio.Event = field(default_factory=asyncio.Event)
    extra_args: list[str] = field(default_factory=list)   # e.g. its rank in a distributed pool
    health_watch: asyncio.Task[None] | None = None   # follows its health while it serves
    detail: str = ""                  # why it is not serving, as it says (its own Pool/Status)
    replaced: int = 0                 # engines it created again after they died, as it says

    @property
    def address(self) -> str:
        return f"unix:{self.socket_path}"

    @property
    def lane_path(self) -> str:
        return lane_path(self.socket_path)

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc is not None else 0


def worker_command(wp: WorkerProc, cfg: PoolConfig, max_request_bytes: int = 64 * 1024 * 1024) -> list[str]:
    """`worker_args` may say `{index}` (the worker's slot) and `{workers}` (the pool size), e.g. for
    `--dist-rank {index}`."""
    cmd = [sys.executable, "-S", "-c", _LAUNCHER, str(os.getpid()),
           "-m", "bridge_server.cli", "worker", "--listen", wp.address, "--worker-id", wp.id,
           "--lane", wp.lane_path, "--grace", str(cfg.worker_grace_s),
           "--probe-interval", str(cfg.probe_interval_s), "--probe-timeout", str(cfg.probe_timeout_s),
           "--reader-stall", str(cfg.reader_stall_s), "--unread-request-s", str(cfg.unread_request_s),
           "--idle-engine-s", str(cfg.idle_engine_s), "--orphan-ref-s", str(cfg.orphan_ref_s)]
    if not cfg.warmup:
        cmd.append("--no-warmup")
    cmd += ["--max-engines-per-client", str(cfg.max_engines_per_client), "--max-sessions", str(cfg.max_sessions),
            "--max-refs-per-client", str(cfg.max_refs_per_client),
            "--max-ref-bytes-per-client", str(cfg.max_ref_bytes_per_client),
            "--max-prompt-chars", str(cfg.max_prompt_chars), "--outside-ranks", str(cfg.outside_ranks),
            "--max-live-sequences", str(cfg.max_live_sequences), "--grammar-compile-s", str(cfg.grammar_compile_s),
            "--max-request-bytes", str(max_request_bytes)]
    for option, values in (("--collective-rpc-method", cfg.collective_rpc_methods), ("--model-dir", cfg.model_dirs),
                           ("--lora-dir", cfg.lora_dirs), ("--rendezvous-host", cfg.rendezvous_hosts),
                           ("--engine-arg-allowed", cfg.engine_args_allowed), ("--operator", cfg.operators)):
        for value in values:
            cmd += [option, value]
    if cfg.objects:
        cmd += ["--objects", json.dumps([o.to_json() for o in cfg.objects])]
    return cmd + wp.extra_args + [a.replace("{index}", str(wp.index)).replace("{workers}", str(cfg.workers))
                                  for a in cfg.worker_args]


async def spawn(wp: WorkerProc, cfg: PoolConfig, max_request_bytes: int = 64 * 1024 * 1024) -> None:
    out: IO[bytes] | None = None
    if cfg.log_dir:
        os.makedirs(cfg.log_dir, exist_ok=True)
        out = open(os.path.join(cfg.log_dir, f"{wp.id}.log"), "ab")   # noqa: SIM115 - the child keeps it
    try:
        wp.proc = await asyncio.create_subprocess_exec(
            *worker_command(wp, cfg, max_request_bytes), stdin=subprocess.DEVNULL, stdout=out,
            stderr=subprocess.STDOUT if out else None, env={**os.environ, **cfg.env}, start_new_session=True)
    finally:
        if out is not None:
            out.close()


async def _exited_within(wp: WorkerProc, seconds: float) -> bool:
    try:
        await asyncio.wait_for(wp.exited.wait(), seconds)
    except asyncio.TimeoutError:
        return False
    return True


async def wait_ready(wp: WorkerProc, timeout_s: float, cancelled: asyncio.Event) -> grpc.aio.Channel | None:
    """Waits for the worker's health check to pass; returns the channel to it, or None (then the
    process is being killed, and `wp.exit_description` says why)."""
    deadline = wp.started + timeout_s
    # The worker binds its socket early (health NOT_SERVING while it builds its objects); a channel
    # opened before that would sit in gRPC's reconnect backoff and notice readiness seconds late.
    while not os.path.exists(wp.socket_path) and time.monotonic() < deadline and not cancelled.is_set():
        if await _exited_within(wp, 0.05):
            return None
    channel = grpc.aio.insecure_channel(wp.address, options=CHANNEL_OPTIONS)
    stub = health_pb2_grpc.HealthStub(channel)
    while not wp.exited.is_set():
        if time.monotonic() > deadline or cancelled.is_set():
            wp.exit_description = "stopped while starting" if cancelled.is_set() else f"not healthy within {timeout_s:g} s"
            wp.expected_exit = cancelled.is_set()
            kill_group(wp.pid)
            break
        try:
            reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
            if reply.status == health_pb2.HealthCheckResponse.SERVING:
                return channel
        except grpc.aio.AioRpcError:
            pass
        await _exited_within(wp, 0.1)
    await channel.close()
    return None


async def terminate(wp: WorkerProc, grace_s: float) -> None:
    """SIGTERM (the worker finishes its calls and exits), then SIGKILL to the whole group if it lingers.
    Returns once the exit watcher has seen the process end."""
    if wp.exited.is_set() or wp.proc is None:
        return
    wp.expected_exit = True
    wp.state = STOPPING
    try:
        wp.proc.send_signal(signal.SIGTERM)
    except ProcessLookupError:
        pass
    if not await _exited_within(wp, grace_s + 5):
        kill_group(wp.pid)
        await wp.exited.wait()
