"""The command lines the Elixir child spec (`VllmBridge.Server`) runs, run here as it runs them.

CI has no Elixir, so the command lines come from `mix_client_example/test/fixtures/serve_command.tsv`,
which the ExUnit tests check against `VllmBridge.Server.command/2`. Here: every line is one that
`vllm-bridge serve` accepts, and a server started the way an Elixir Port starts it (its own session,
stdin a pipe that stays open, stdout and stderr one pipe) serves, reports its port in the ready file,
answers health, and stops with everything it started: on SIGTERM (how the child spec stops it), and
when its stdin reaches end-of-file (what happens when the BEAM dies, even by SIGKILL).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = ROOT / "mix_client_example" / "test" / "fixtures" / "serve_command.tsv"
VLLM_BRIDGE = ROOT / ".venv" / "bin" / "vllm-bridge"
PLAIN_POOL = '[[pools]]\nname = "plain"\nworkers = 1\n'   # no engine: starts in seconds


def cases() -> dict[str, list[str]]:
    lines = [line for line in FIXTURE.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]
    return {name: args for name, *args in (line.split("\t") for line in lines)}


def unknown_flags(args: list[str]) -> list[str]:
    """The options of a command line that `vllm-bridge serve` does not accept (yet)."""
    _, extra = build_parser().parse_known_args(args)
    return [x for x in extra if x.startswith("--")]


def test_the_fixture_has_the_cases_the_elixir_tests_build() -> None:
    assert set(cases()) == {"default", "config", "token", "tls", "insecure"}
    for args in cases().values():
        assert args[:3] == ["serve", "--listen", args[2]] and "--stdin-watch" in args and "--ready-file" in args


@pytest.mark.parametrize("name", sorted(cases()))
def test_every_command_line_is_one_serve_accepts(name: str) -> None:
    args = cases()[name]
    assert not unknown_flags(args), f"`vllm-bridge serve` does not take {unknown_flags(args)}"
    parsed = build_parser().parse_args(args)
    assert parsed.command == "serve" and parsed.listen == args[2]


# Holds the server's pipes as the BEAM does (an Elixir Port: its own session, stdin a pipe held open,
# stdout and stderr one pipe read line by line), prints its pid, then reads its output until killed.
BEAM = """
import subprocess, sys
proc = subprocess.Popen(sys.argv[1:], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                        stderr=subprocess.STDOUT, start_new_session=True)
print(proc.pid, flush=True)
for line in proc.stdout:
    sys.stdout.buffer.write(line)
    sys.stdout.flush()
"""


def start_as_the_child_spec_does(tmp: Path, name: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """The stand-in BEAM, the server's pid, and its ready file."""
    config = tmp / "plain.toml"
    config.write_text(PLAIN_POOL)
    ready = tmp / "ready"
    args = [{"CONFIG": str(config), "READY_FILE": str(ready)}.get(a, a) for a in cases()[name]]
    beam = subprocess.Popen([sys.executable, "-c", BEAM, str(VLLM_BRIDGE), *args], stdout=(tmp / "out").open("wb"),
                            stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + 30
    while not (tmp / "out").read_text().strip():
        assert beam.poll() is None and time.monotonic() < deadline, "the stand-in BEAM did not start the server"
        time.sleep(0.05)
    return beam, int((tmp / "out").read_text().split()[0]), ready


def wait_serving(server: int, ready: Path, out: Path, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not ready.exists():
        assert psutil.pid_exists(server) and psutil.Process(server).status() != psutil.STATUS_ZOMBIE, \
            f"the server exited:\n{out.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no ready file:\n{out.read_text()[-3000:]}"
        time.sleep(0.1)
    address = f"127.0.0.1:{int(ready.read_text())}"
    with grpc.insecure_channel(address) as channel:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def alive(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those still running after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


@pytest.fixture()
def started() -> Iterator[list[int]]:
    """Sessions to kill if a test fails half way (the stand-in BEAM's and the server's)."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def serving_as_the_child_spec_does(tmp: Path, started: list[int]) -> tuple[subprocess.Popen[bytes], int,
                                                                          list[psutil.Process]]:
    """The stand-in BEAM, the server's pid, and the server's processes, once it says SERVING."""
    beam, server, ready = start_as_the_child_spec_does(tmp, "config")
    started += [beam.pid, server]
    wait_serving(server, ready, tmp / "out")
    return beam, server, tree(server)


def test_the_child_spec_command_serves_and_stops_on_sigterm(tmp_path: Path, started: list[int]) -> None:
    beam, server, procs = serving_as_the_child_spec_does(tmp_path, started)
    assert len(procs) >= 2, "the server and its worker"
    os.kill(server, signal.SIGTERM)                   # how VllmBridge.Server stops it
    assert not alive(procs, 60), f"left running after SIGTERM:\n{(tmp_path / 'out').read_text()[-3000:]}"
    beam.wait(10)


def test_nothing_remains_when_the_beam_is_killed(tmp_path: Path, started: list[int]) -> None:
    """The BEAM dies by SIGKILL: the server's stdin reaches end-of-file, its stdout has no reader."""
    beam, _, procs = serving_as_the_child_spec_does(tmp_path, started)
    beam.kill()
    beam.wait(10)
    assert not alive(procs, 60), "left running after the BEAM was killed"
