"""The pool configuration: a TOML file, the built-in default, and command-line overrides.

One place decides what a pool is, so that the supervisor, the router and the CLI agree on names,
defaults and limits. Neither vLLM nor torch is imported here: the CLI builds its parser from this
module, and `vllm-bridge status` must not pay for importing vLLM.

File layout (every key optional except a pool's `name`)::

    listen = "127.0.0.1:50051"
    metrics_port = 9464          # 0: no metrics endpoint
    grace_s = 30                 # SIGTERM/SIGINT: time in-flight calls get to finish
    min_ping_interval_s = 10     # clients may keepalive-ping an idle connection this often (no more)
    loop = "uvloop"              # the server's event loop: "uvloop" or "asyncio" (see wire/eventloop.py)
    default_pool = "default"     # calls that name no pool
    token_file = "/etc/vllm-bridge/tokens"   # bearer tokens (README, Security); also tls_cert, tls_key,
                                 # tls_client_ca, insecure, auth_health, max_request_bytes
    max_unread_bytes = 1073741824   # replies held for callers that do not read them, in all (0: no bound)
    max_connections = 0          # clients' connections at once (0: the open files less a quarter, 1,024 at least)
    max_receiving_bytes = 1073741824   # requests read at once, each counted as max_request_bytes (16 of 64 MiB;
                                 # a host a quarter of them)
    receive_s = 30               # how long one request may take to arrive
    stall_s = 10                 # how long one request may hold a place to be read in while others wait
    streams_per_host = 32        # request streams (Multiplex, reflection) one host holds open at once

    [[pools]]
    name = "default"
    workers = 2
    max_concurrent = 64          # calls one worker runs at once
    queue_size = 1024            # calls waiting for a slot, per pool
    host_slot_share = 0.9375     # of a pool's slots, the most one host's calls hold (the rest rounded down kept)
    affinity = "hint"            # hint | strict_queue | strict_fail_fast
    worker_args = ["--ref-ttl", "3600"]
    warmup = true                # engines run once before they serve (no client pays the first use)
    probe_interval_s = 5         # engine liveness: probed this often ...
    probe_timeout_s = 10         # ... and dead when two probes in a row go unanswered this long
    unhealthy_timeout_s = 300    # a worker not serving (NOT_SERVING) this long is replaced
    reader_stall_s = 60          # a stream whose caller reads nothing this long ends, freeing its slot
    contended_stall_s = 5        # ... and only this long while other calls wait for a slot
    unread_request_s = 30        # a request nobody can read (add_request's) ends this long after it started
    idle_engine_s = 900          # without authentication, an engine unnamed this long, with no live request, goes
    orphan_ref_s = 3600          # without authentication, a ref whose maker's connection closed, unused this long, goes
    max_live_sequences = 12288   # sequences the published engine holds live, every client's together
    grammar_compile_s = 5        # how long a new grammar's trial (compiling, generating) may take; 0: none
    model_dirs = ["/models"]     # what clients may do and make: model_dirs, lora_dirs, rendezvous_hosts,
    max_engines_per_client = 2   # collective_rpc_methods, engine_args_allowed, max_engines_per_client,
                                 # max_sessions, max_refs_per_client, max_ref_bytes_per_client,
                                 # max_prompt_chars, operators, outside_ranks
                                 # (README, Security)
    [pools.env]
    VLLM_CPU_KVCACHE_SPACE = "2"
    [[pools.objects]]
    name = "engine"
    target = "vllm.AsyncLLMEngine.from_engine_args"
    kwargs = { engine_args = { model = "/models/tiny", dtype = "float32" } }

Command-line overrides: `--listen`, `--metrics-port`, `--grace`, `--loop`, `--default-pool`, the pool shorthands
(`--workers`, `--max-concurrent`, `--queue-size`, `--affinity`: every pool) and the general
`--set POOL.KEY=VALUE` (VALUE in TOML syntax; a bare word is a string; POOL `*` means every pool).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bridge_server.pool.backlog import DEFAULT_MAX_UNREAD_BYTES
from bridge_server.wire.eventloop import DEFAULT_LOOP, LOOPS
from bridge_server.wire.protocol import MIN_PING_INTERVAL_S
from bridge_server.wire.receiving import DEFAULT_RECEIVING_BYTES, STALL_S
from bridge_server.wire.security import add_arguments as add_security_arguments
from bridge_server.wire.stall import CONTENDED_STALL_S, READER_STALL_S

AFFINITY_MODES = ("hint", "strict_queue", "strict_fail_fast")
POOL_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


class ConfigError(ValueError):
    """A configuration that cannot be served; the message names the offending key."""


@dataclass
class ObjectSpec:
    """An object every worker of the pool creates at start and publishes by name (`--objects`)."""

    name: str
    target: str
    args: list[Any] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "target": self.target, "args": self.args, "kwargs": self.kwargs}


@dataclass
class DistributedConfig:
    """A pool whose workers are the ranks of one torch.distributed group (`[pools.distributed]`)."""

    backend: str = "gloo"                # gloo on CPU, nccl with GPUs
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1

    def worker_args(self, rank: int, world_size: int, init_method: str) -> list[str]:
        return ["--dist-backend", self.backend, "--dist-world-size", str(world_size), "--dist-rank", str(rank),
                "--dist-init", init_method, "--dist-tp", str(self.tensor_parallel_size),
                "--dist-pp", str(self.pipeline_parallel_size)]


DIST_BACKENDS = ("gloo", "nccl")


def _distributed(where: str, raw: Any) -> DistributedConfig | None:
    if raw is None or isinstance(raw, DistributedConfig):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: expected a table, got {raw!r}")
    d = DistributedConfig()
    for key, value in raw.items():
        if not hasattr(d, key):
            raise ConfigError(f"{where}.{key}: unknown key; known: backend, tensor_parallel_size, "
                              f"pipeline_parallel_size")
        setattr(d, key, _coerce(f"{where}.{key}", value, getattr(DistributedConfig(), key)))
    return d


@dataclass
class PoolConfig:
    name: str
    workers: int = 1
    max_concurrent: int = 64
    queue_size: int = 1024
    host_slot_share: float = 0.9375   # of a pool's slots, the most one host's calls (or an identity's) hold at once
    affinity: str = "hint"
    env: dict[str, str] = field(default_factory=dict)
    objects: list[ObjectSpec] = field(default_factory=list)
    worker_args: list[str] = field(default_factory=list)   # extra `vllm-bridge worker` options
    start_timeout_s: float = 300.0       # from spawn to a passing health check
    restart_backoff_s: float = 0.5       # first restart delay; doubles per crash in the window
    restart_backoff_max_s: float = 30.0
    max_restarts: int = 5                # more crashes than this within the window: degraded
    restart_window_s: float = 60.0
    degraded_retry_s: float = 300.0      # a degraded pool tries its failed workers again this often; 0: never
    recycle_after_calls: int = 0         # 0: never
    recycle_after_s: float = 0.0         # 0: never
    drain_timeout_s: float = 60.0        # a recycled worker's calls finish and refs are released within this
    warmup: bool = True                  # engines run once before their worker (or their creator) gets them
    probe_interval_s: float = 5.0        # how often a worker probes its engines' liveness
    probe_timeout_s: float = 10.0        # two probes unanswered this long (no progress meanwhile): dead
    unhealthy_timeout_s: float = 300.0   # a worker not serving for this long is replaced (0: never)
    reader_stall_s: float = READER_STALL_S   # a stream whose caller reads nothing this long ends (0: never)
    contended_stall_s: float = CONTENDED_STALL_S   # the same while calls wait for a slot (0: reader_stall_s only)
    unread_request_s: float = 30.0   # a request nobody can read (add_request's) ends this long after it started
    idle_engine_s: float = 900.0     # without authentication: an engine unnamed this long, idle, is released (0: never)
    orphan_ref_s: float = 3600.0     # without authentication: a ref of a closed connection, unused this long, goes (0: never)
    max_live_sequences: int = 12_288   # sequences a published engine holds live, every client's (0: no bound)
    grammar_compile_s: float = 5.0   # a new grammar's trial (compile, generate) longer than this is refused
    worker_grace_s: float = 10.0         # the worker's own grace on SIGTERM
    log_dir: str = ""                    # per-worker log files here; empty: inherit the server's
    distributed: DistributedConfig | None = None   # the workers are the ranks of one group
    # What a client may do and make (README, Security): every worker of the pool enforces it.
    collective_rpc_methods: list[str] = field(default_factory=list)   # worker methods collective_rpc may name
    model_dirs: list[str] = field(default_factory=list)    # client-made engines load models from under these
    lora_dirs: list[str] = field(default_factory=list)     # LoRA adapters load from under these (and model_dirs)
    rendezvous_hosts: list[str] = field(default_factory=lambda: ["127.0.0.1", "localhost", "::1"])
    engine_args_allowed: list[str] = field(default_factory=list)   # engine arguments beyond the safe ones
    operators: list[str] = field(default_factory=list)   # identities that may change published engines ("*": all)
    max_engines_per_client: int = 2      # engines one client may make per worker (published ones aside)
    max_sessions: int = 10_000           # sessions per worker
    max_refs_per_client: int = 100_000   # refs one client may hold per worker
    max_ref_bytes_per_client: int = 1 << 30   # bytes of tensors one client's refs may hold per worker (0: any)
    max_prompt_chars: int = 1_000_000    # the longest prompt
    outside_ranks: int = 0               # ranks a client's process group may have beyond the pool's own


@dataclass
class ServerConfig:
    listen: str = "127.0.0.1:50051"
    metrics_port: int = 0
    metrics_host: str = "127.0.0.1"
    grace_s: float = 30.0
    loop: str = DEFAULT_LOOP
    default_pool: str = ""               # empty: the first pool
    min_ping_interval_s: float = MIN_PING_INTERVAL_S   # clients may keepalive-ping an idle connection this often
    max_request_bytes: int = 64 * 1024 * 1024   # the largest request a client may send
    max_unread_bytes: int = DEFAULT_MAX_UNREAD_BYTES   # replies waiting for callers that do not read, in all
    max_connections: int = 0             # clients' connections at once (0: what the open files allow)
    max_receiving_bytes: int = DEFAULT_RECEIVING_BYTES   # requests being read at once, each counted as max_request_bytes
    receive_s: float = 30.0              # how long one request may take to arrive
    stall_s: float = STALL_S             # how long one may hold a place to be read in while others wait
    streams_per_host: int = 32           # request streams (Multiplex, reflection) one host holds open
    # Security (README, Security): beyond loopback the server needs TLS and client authentication.
    token_file: str = ""                 # bearer tokens, `token` or `name:token` per line
    tls_cert: str = ""
    tls_key: str = ""
    tls_client_ca: str = ""              # mutual TLS
    insecure: bool = False               # listen beyond this machine without them anyway
    auth_health: bool = False            # health and reflection need a token too
    pools: list[PoolConfig] = field(default_factory=list)

    def pool(self, name: str) -> PoolConfig:
        for p in self.pools:
            if p.name == name:
                return p
        raise ConfigError(f"no pool {name!r}; pools: {', '.join(p.name for p in self.pools)}")

    @property
    def default_pool_name(self) -> str:
        return self.default_pool or self.pools[0].name


def default_engine_args(model: str) -> dict[str, Any]:
    """The engine the built-in default serves: a small model (the offline tiny one that
    `vllm-bridge make-tiny-model` builds), small enough for a laptop CPU. It schedules by priority,
    which the server sets for each request: fair share between clients (`adapters/fair_share.py`)."""
    return {"model": model, "dtype": "float32", "max_model_len": 256, "enforce_eager": True, "max_num_seqs": 16,
            "scheduling_policy": "priority"}


def default_config(model: str) -> ServerConfig:
    """`vllm-bridge serve` with no config file: one pool, one worker publishing an engine on `model`
    as `engine`."""
    engine = ObjectSpec("engine", "vllm.AsyncLLMEngine.from_engine_args",
                        kwargs={"engine_args": default_engine_args(model)})
    return ServerConfig(pools=[PoolConfig("default", workers=1, max_concurrent=64, objects=[engine])])


# ---------------------------------------------------------------------------------------- parsing

_POOL_FIELDS = {f.name: f for f in dataclasses.fields(PoolConfig)}
_SERVER_FIELDS = {f.name for f in dataclasses.fields(ServerConfig)} - {"pools"}


def _coerce(where: str, value: Any, like: Any) -> Any:
    """Checks a value against the type of the field's default (TOML ints are fine for floats)."""
    if isinstance(like, bool):
        ok = isinstance(value, bool)
    elif isinstance(like, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(like, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(like, str):
        ok = isinstance(value, str)
    elif isinstance(like, list):
        ok = isinstance(value, list)
    elif isinstance(like, dict):
        ok = isinstance(value, dict)
    else:
        ok = True
    if not ok:
        raise ConfigError(f"{where}: expected {type(like).__name__}, got {value!r}")
    return value


def _object(where: str, raw: Any) -> ObjectSpec:
    if isinstance(raw, ObjectSpec):
        return raw
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("target"), str):
        raise ConfigError(f"{where}: an object needs a string `name` and `target`, got {raw!r}")
    unknown = set(raw) - {"name", "target", "args", "kwargs"}
    if unknown:
        raise ConfigError(f"{where}: unknown keys {sorted(unknown)}")
    return ObjectSpec(raw["name"], raw["target"], list(raw.get("args", [])), dict(raw.get("kwargs", {})))


def _set_pool_key(pool: PoolConfig, key: str, value: Any) -> None:
    where = f"pools.{pool.name}.{key}"
    if key not in _POOL_FIELDS or key == "name":
        raise ConfigError(f"{where}: unknown pool key; known: {', '.join(k for k in _POOL_FIELDS if k != 'name')}")
    if key == "objects":
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a list of objects")
        value = [_object(f"{where}[{i}]", o) for i, o in enumerate(value)]
    elif key == "env":
        value = {str(k): str(v) for k, v in _coerce(where, value, {}).items()}
    elif key == "distributed":
        value = _distributed(where, value)
    elif key in ("worker_args", "collective_rpc_methods", "model_dirs", "lora_dirs", "rendezvous_hosts",
                 "engine_args_allowed", "operators"):
        value = [str(a) for a in _coerce(where, value, [])]
    else:
        value = _coerce(where, value, getattr(PoolConfig(name="x"), key))
    setattr(pool, key, value)


def pool_from_dict(raw: dict[str, Any]) -> PoolConfig:
    name = raw.get("name")
    if not isinstance(name, str):
        raise ConfigError(f"every pool needs a string `name`, got {raw!r}")
    pool = PoolConfig(name=name)
    for key, value in raw.items():
        if key != "name":
            _set_pool_key(pool, key, value)
    return pool


def config_from_dict(raw: dict[str, Any]) -> ServerConfig:
    cfg = ServerConfig()
    for key, value in raw.items():
        if key == "pools":
            if not isinstance(value, list):
                raise ConfigError("pools: expected an array of tables ([[pools]])")
            cfg.pools = [pool_from_dict(p) for p in value]
        elif key in _SERVER_FIELDS:
            setattr(cfg, key, _coerce(key, value, getattr(ServerConfig(), key)))
        else:
            raise ConfigError(f"{key}: unknown key; known: {', '.join(sorted(_SERVER_FIELDS | {'pools'}))}")
    return cfg


def load_config(path: str | Path) -> ServerConfig:
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    return validate(config_from_dict(raw))


def validate(cfg: ServerConfig) -> ServerConfig:
    """Refuses what would fail later, at a worse moment (a bad pool name breaks ref routing)."""
    if not cfg.pools:
        raise ConfigError("no pools configured")
    seen: set[str] = set()
    for p in cfg.pools:
        if not POOL_NAME.match(p.name):
            raise ConfigError(f"pool name {p.name!r}: use letters, digits, '_' and '-' only")
        if p.name in seen:
            raise ConfigError(f"pool {p.name!r} is declared twice")
        seen.add(p.name)
        if p.workers < 1 or p.max_concurrent < 1 or p.queue_size < 0:
            raise ConfigError(f"pool {p.name!r}: workers and max_concurrent must be >= 1, queue_size >= 0")
        if not 0 < p.host_slot_share <= 1:
            raise ConfigError(f"pool {p.name!r}: host_slot_share must be more than 0 and at most 1, got "
                              f"{p.host_slot_share:g}")
        for key, value in vars(p).items():
            if key.endswith("_s") and isinstance(value, (int, float)) and value < 0:
                raise ConfigError(f"pool {p.name!r}: {key} must be >= 0, got {value:g}")
        for key in ("max_engines_per_client", "max_sessions", "max_refs_per_client", "max_ref_bytes_per_client",
                    "max_prompt_chars", "outside_ranks", "max_live_sequences"):
            if getattr(p, key) < 0:
                raise ConfigError(f"pool {p.name!r}: {key} must be >= 0")
        if p.probe_interval_s <= 0 or p.probe_timeout_s <= 0:
            raise ConfigError(f"pool {p.name!r}: probe_interval_s and probe_timeout_s must be > 0")
        if p.affinity not in AFFINITY_MODES:
            raise ConfigError(f"pool {p.name!r}: affinity {p.affinity!r}; expected one of {', '.join(AFFINITY_MODES)}")
        d = p.distributed
        if d is not None:
            if d.backend not in DIST_BACKENDS:
                raise ConfigError(f"pool {p.name!r}: distributed.backend {d.backend!r}; expected one of "
                                  f"{', '.join(DIST_BACKENDS)}")
            if d.tensor_parallel_size * d.pipeline_parallel_size != p.workers:
                raise ConfigError(f"pool {p.name!r}: tensor_parallel_size {d.tensor_parallel_size} x "
                                  f"pipeline_parallel_size {d.pipeline_parallel_size} must equal workers {p.workers}")
            if p.recycle_after_calls or p.recycle_after_s:
                raise ConfigError(f"pool {p.name!r}: a distributed pool cannot recycle workers one at a time "
                                  f"(a group cannot lose a rank); unset recycle_after_calls/recycle_after_s")
        names = [o.name for o in p.objects]
        if len(set(names)) != len(names):
            raise ConfigError(f"pool {p.name!r}: object names repeat: {names}")
    if cfg.default_pool and cfg.default_pool not in seen:
        raise ConfigError(f"default_pool {cfg.default_pool!r} is not a pool; pools: {', '.join(seen)}")
    if cfg.max_request_bytes <= 0:
        raise ConfigError(f"max_request_bytes must be > 0, got {cfg.max_request_bytes}")
    if cfg.max_connections < 0:
        raise ConfigError(f"max_connections must be >= 0 (0: what the open files allow), got {cfg.max_connections}")
    if cfg.max_unread_bytes < 0:
        raise ConfigError(f"max_unread_bytes must be >= 0 (0: no bound), got {cfg.max_unread_bytes}")
    if cfg.min_ping_interval_s <= 0:
        raise ConfigError(f"min_ping_interval_s must be > 0, got {cfg.min_ping_interval_s:g}")
    if cfg.max_receiving_bytes <= 0 or cfg.receive_s <= 0 or cfg.streams_per_host <= 0 or cfg.stall_s <= 0:
        raise ConfigError(f"max_receiving_bytes, receive_s, stall_s and streams_per_host must be > 0, got "
                          f"{cfg.max_receiving_bytes}, {cfg.receive_s:g}, {cfg.stall_s:g} and {cfg.streams_per_host}")
    if cfg.metrics_port < 0:
        raise ConfigError("metrics_port must be >= 0")
    if cfg.loop not in LOOPS:
        raise ConfigError(f"loop: expected one of {', '.join(LOOPS)}, got {cfg.loop!r}")
    return cfg


# ------------------------------------------------------------------------------- command line

def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    """The `vllm-bridge serve` options; None means "as the config says"."""
    p.add_argument("--config", default=None, help="TOML pool config (default: one pool serving the tiny model)")
    p.add_argument("--listen", default=None, help="host:port or unix:/path (default 127.0.0.1:50051)")
    p.add_argument("--metrics-port", type=int, default=None, help="Prometheus metrics HTTP port (0: off)")
    p.add_argument("--metrics-host", default=None)
    p.add_argument("--grace", type=float, default=None, help="seconds in-flight calls get on SIGTERM/SIGINT")
    p.add_argument("--min-ping-interval", type=float, default=None, metavar="S",
                   help=f"clients may send keepalive pings on an idle connection this often (default {MIN_PING_INTERVAL_S:g} s)")
    p.add_argument("--loop", choices=LOOPS, default=None, help=f"the server's event loop (default {DEFAULT_LOOP})")
    p.add_argument("--default-pool", default=None, help="the pool of calls that name none")
    p.add_argument("--workers", type=int, default=None, help="workers per pool (every pool)")
    p.add_argument("--max-concurrent", type=int, default=None, help="calls per worker at once (every pool)")
    p.add_argument("--queue-size", type=int, default=None, help="waiting calls per pool (every pool)")
    p.add_argument("--affinity", default=None, choices=AFFINITY_MODES, help="default affinity (every pool)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="POOL.KEY=VALUE",
                   help="override a pool key, VALUE in TOML syntax (POOL '*': every pool); repeatable")
    p.add_argument("--ready-file", default=None, help="write the bound port here once every pool is up")
    s = p.add_argument_group("security (README, Security)")
    add_security_arguments(s, unset=True)
    s.add_argument("--max-request-bytes", type=int, default=None, metavar="N", help="the largest request")
    s.add_argument("--max-unread-bytes", type=int, default=None, metavar="N",
                   help="replies held for callers that do not read them, in all (0: no bound)")
    p.add_argument("--stdin-watch", action="store_true",
                   help="stop (as on SIGTERM) when stdin closes: for a parent that runs the server through a "
                        "pipe (an Elixir Port), so that the server never outlives it")


def _toml_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text   # a bare word: a string


def apply_overrides(cfg: ServerConfig, args: argparse.Namespace) -> ServerConfig:
    for attr, key in (("listen", "listen"), ("metrics_port", "metrics_port"), ("metrics_host", "metrics_host"),
                      ("grace", "grace_s"), ("loop", "loop"), ("default_pool", "default_pool"),
                      ("min_ping_interval", "min_ping_interval_s"), ("token_file", "token_file"),
                      ("tls_cert", "tls_cert"), ("tls_key", "tls_key"), ("tls_client_ca", "tls_client_ca"),
                      ("insecure", "insecure"), ("auth_health", "auth_health"),
                      ("max_request_bytes", "max_request_bytes"), ("max_unread_bytes", "max_unread_bytes")):
        value = getattr(args, attr, None)
        if value is not None:
            setattr(cfg, key, _coerce(f"--{attr.replace('_', '-')}", value, getattr(ServerConfig(), key)))
    for attr in ("workers", "max_concurrent", "queue_size", "affinity"):
        value = getattr(args, attr, None)
        if value is not None:
            for pool in cfg.pools:
                _set_pool_key(pool, attr, value)
    for item in getattr(args, "overrides", []) or []:
        lhs, eq, rhs = item.partition("=")
        pool_name, dot, key = lhs.strip().partition(".")
        if not eq or not dot:
            raise ConfigError(f"--set {item!r}: expected POOL.KEY=VALUE")
        pools = cfg.pools if pool_name == "*" else [cfg.pool(pool_name)]
        for pool in pools:
            _set_pool_key(pool, key.strip(), _toml_value(rhs.strip()))
    return validate(cfg)


def config_from_args(args: argparse.Namespace, default_model: Callable[[], str]) -> ServerConfig:
    """The config file's (or, with none, the built-in default's on `default_model()`), overridden."""
    cfg = load_config(args.config) if getattr(args, "config", None) else default_config(default_model())
    return apply_overrides(cfg, args)
