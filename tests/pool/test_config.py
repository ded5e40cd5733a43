"""The pool configuration: the TOML file, the built-in default, command-line overrides, refusals.
No processes: these run in milliseconds."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bridge_server.cli import build_parser
from bridge_server.pool.config import (
    ConfigError,
    ObjectSpec,
    PoolConfig,
    ServerConfig,
    apply_overrides,
    config_from_args,
    default_config,
    load_config,
)
from bridge_server.pool.workerproc import WorkerProc, worker_command
from bridge_server.tools.tiny_model import ensure_tiny_model

FULL = """
listen = "127.0.0.1:6000"
metrics_port = 9464
grace_s = 12
loop = "asyncio"
default_pool = "gen"

[[pools]]
name = "gen"
workers = 2
max_concurrent = 32
queue_size = 100
affinity = "strict_queue"
worker_args = ["--ref-ttl", "60", "--dist-rank", "{index}"]
recycle_after_calls = 1000
max_live_sequences = 4096
unread_request_s = 12.5
grammar_compile_s = 4
[pools.env]
VLLM_CPU_KVCACHE_SPACE = "2"
[[pools.objects]]
name = "engine"
target = "vllm.AsyncLLMEngine.from_engine_args"
kwargs = { engine_args = { model = "/m", dtype = "float32", max_model_len = 256 } }

[[pools]]
name = "tools_2"
"""


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


def no_default() -> str:
    raise AssertionError("a config file was given: the built-in default must not be built")


def test_a_full_file_is_read(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(FULL)
    cfg = load_config(tmp_path / "p.toml")
    assert (cfg.listen, cfg.metrics_port, cfg.grace_s, cfg.default_pool_name) == ("127.0.0.1:6000", 9464, 12.0, "gen")
    assert cfg.loop == "asyncio"
    gen, tools = cfg.pools
    assert (gen.workers, gen.max_concurrent, gen.queue_size, gen.affinity) == (2, 32, 100, "strict_queue")
    assert gen.env == {"VLLM_CPU_KVCACHE_SPACE": "2"} and gen.recycle_after_calls == 1000
    assert gen.objects == [ObjectSpec("engine", "vllm.AsyncLLMEngine.from_engine_args",
                                      kwargs={"engine_args": {"model": "/m", "dtype": "float32", "max_model_len": 256}})]
    assert tools == PoolConfig("tools_2")
    # What a worker of `gen` is started with: its id, its socket, the objects as JSON, `{index}` filled in.
    cmd = worker_command(WorkerProc("gen-1-g3", "gen", 1, 3, "/tmp/x/1.sock"), gen)
    tail = cmd[cmd.index("bridge_server.cli"):]
    assert tail[:6] == ["bridge_server.cli", "worker", "--listen", "unix:/tmp/x/1.sock", "--worker-id", "gen-1-g3"]
    assert '"target": "vllm.AsyncLLMEngine.from_engine_args"' in tail[tail.index("--objects") + 1]
    assert tail[-4:] == ["--ref-ttl", "60", "--dist-rank", "1"]
    for option, value in (("--max-live-sequences", "4096"), ("--unread-request-s", "12.5"),
                          ("--grammar-compile-s", "4.0")):
        assert tail[tail.index(option) + 1] == value
    assert "--objects" not in worker_command(WorkerProc("tools_2-0-g1", "tools_2", 0, 1, "/s"), tools)


def test_every_option_can_be_overridden_on_the_command_line(tmp_path: Path) -> None:
    (tmp_path / "p.toml").write_text(FULL)
    cfg = config_from_args(serve_args("--config", str(tmp_path / "p.toml"), "--listen", "unix:/tmp/r.sock",
                                      "--metrics-port", "0", "--grace", "3", "--max-concurrent", "8", "--loop", "uvloop",
                                      "--set", "gen.workers=3", "--set", "tools_2.affinity=strict_fail_fast",
                                      "--set", 'gen.worker_args=["--ref-ttl", "5"]', "--set", "*.queue_size=7",
                                      "--set", "gen.env={A = \"1\"}", "--default-pool", "tools_2"),
                           default_model=no_default)
    gen, tools = cfg.pools
    assert (cfg.listen, cfg.metrics_port, cfg.grace_s, cfg.default_pool_name) == ("unix:/tmp/r.sock", 0, 3.0, "tools_2")
    assert cfg.loop == "uvloop"
    assert (gen.workers, gen.max_concurrent, gen.queue_size, gen.worker_args, gen.env) == \
        (3, 8, 7, ["--ref-ttl", "5"], {"A": "1"})
    assert (tools.max_concurrent, tools.queue_size, tools.affinity) == (8, 7, "strict_fail_fast")


def test_the_built_in_default_serves_the_tiny_model() -> None:
    cfg = default_config(str(ensure_tiny_model()))
    (pool,) = cfg.pools
    assert (pool.name, pool.workers, pool.max_concurrent) == ("default", 1, 64)
    (engine,) = pool.objects
    assert (engine.name, engine.target) == ("engine", "vllm.AsyncLLMEngine.from_engine_args")
    args = engine.kwargs["engine_args"]
    assert Path(args["model"]).is_dir() and args["dtype"] == "float32" and args["max_model_len"] == 256
    assert args["enforce_eager"] is True and args["max_num_seqs"] == 16
    assert cfg.listen == "127.0.0.1:50051" and cfg.loop == "uvloop"


@pytest.mark.parametrize("text,needle", [
    ('[[pools]]\nname = "a.b"', "use letters, digits"),
    ('[[pools]]\nname = "a"\n[[pools]]\nname = "a"', "declared twice"),
    ('[[pools]]\nname = "a"\nworkers = 0', "workers and max_concurrent must be >= 1"),
    ('[[pools]]\nname = "a"\naffinity = "sometimes"', "affinity 'sometimes'"),
    ('[[pools]]\nname = "a"\nworkerz = 2', "unknown pool key"),
    ('[[pools]]\nname = "a"\nworkers = "2"', "expected int"),
    ('[[pools]]\nname = "a"\n[[pools.objects]]\nname = "e"', "needs a string `name` and `target`"),
    ('listen = 5\n[[pools]]\nname = "a"', "listen: expected str"),
    ('lissen = "x"\n[[pools]]\nname = "a"', "lissen: unknown key"),
    ('default_pool = "b"\n[[pools]]\nname = "a"', "default_pool 'b' is not a pool"),
    ('grace_s = 1', "no pools configured"),
    ('loop = "trio"\n[[pools]]\nname = "a"', "loop: expected one of uvloop, asyncio, got 'trio'"),
    ('[[pools]]\nname = "a"\ndegraded_retry_s = -1', "pool 'a': degraded_retry_s must be >= 0, got -1"),
    ('max_connections = -1\n[[pools]]\nname = "a"', "max_connections must be >= 0"),
    ('[[pools]]\nname = "a"\nmax_live_sequences = -5', "pool 'a': max_live_sequences must be >= 0"),
    ('[[pools]]\nname = "a"\ngrammar_compile_s = -1', "pool 'a': grammar_compile_s must be >= 0"),
    ('[[pools]]\nname = "a"\nunread_request_s = -1', "pool 'a': unread_request_s must be >= 0"),
    ('[[pools]\nname = "a"', "p.toml"),
])
def test_a_bad_config_is_refused_naming_the_key(tmp_path: Path, text: str, needle: str) -> None:
    (tmp_path / "p.toml").write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path / "p.toml")
    assert needle in str(err.value)


def test_a_bad_override_is_refused() -> None:
    cfg = ServerConfig(pools=[PoolConfig("a")])
    with pytest.raises(ConfigError, match="no pool 'b'; pools: a"):
        apply_overrides(cfg, serve_args("--set", "b.workers=2"))
    with pytest.raises(ConfigError, match="expected POOL.KEY=VALUE"):
        apply_overrides(cfg, serve_args("--set", "workers=2"))
