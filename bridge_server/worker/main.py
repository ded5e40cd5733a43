"""`vllm-bridge worker`: one worker process, as a supervisor (ours, systemd, an Elixir app) starts it.

A worker the pool server starts leads a process group of its own, so that vLLM's engine cores, which
it spawns, can be taken down with it whatever happens to the server.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

from bridge_server.wire import eventloop
from bridge_server.wire.logbudget import budget_logs
from bridge_server.wire.protocol import MIN_PING_INTERVAL_S
from bridge_server.wire.security import SecurityError
from bridge_server.wire.security import add_arguments as add_security_arguments
from bridge_server.wire.stall import READER_STALL_S

if TYPE_CHECKING:   # imported when a worker runs, not when the `vllm-bridge` parser is built
    from bridge_server.wire.security import ServerSecurity
    from bridge_server.worker.server import WorkerConfig

DEFAULT_LISTEN = "127.0.0.1:50051"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `vllm-bridge worker` options."""
    p.add_argument("--listen", default=DEFAULT_LISTEN, help="host:port or unix:/path (default %(default)s)")
    p.add_argument("--worker-id", default="", help="prefix of this worker's ref ids (default: w<pid>)")
    p.add_argument("--session-cap", type=int, default=10_000, help="most refs one session may hold")
    p.add_argument("--ref-ttl", type=float, default=None, help="evict refs idle for this many seconds")
    p.add_argument("--tensor-max-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger tensors are returned as refs")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on shutdown")
    p.add_argument("--ready-file", default=None, help="write the bound port here once serving")
    p.add_argument("--lane", default=None, metavar="PATH",
                   help="also serve the router's lane (Multiplex messages, no gRPC) on this unix socket; "
                        "the pool server sets it")
    p.add_argument("--loop", choices=eventloop.LOOPS, default=eventloop.DEFAULT_LOOP,
                   help="the worker's event loop (default %(default)s)")
    p.add_argument("--objects", default="[]",
                   help='objects to create at start and publish by name, as JSON: '
                        '[{"name": "engine", "target": "vllm.AsyncLLMEngine.from_engine_args", "kwargs": {...}}]')
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="report ready without running each engine once first (the first request then pays "
                        "for vLLM's first-use compilation)")
    p.add_argument("--probe-interval", type=float, default=5.0, metavar="S",
                   help="how often every engine is probed for liveness (default %(default)s s)")
    p.add_argument("--probe-timeout", type=float, default=10.0, metavar="S",
                   help="an engine that answers no probe within this, twice in a row, while making no progress, is dead "
                        "(default %(default)s s)")
    p.add_argument("--min-ping-interval", type=float, default=MIN_PING_INTERVAL_S, metavar="S",
                   help="clients may send keepalive pings on an idle connection this often (default %(default)s s)")
    s = p.add_argument_group("security: who may call, over what, and what a client may make (README, Security)")
    add_security_arguments(s, unset=False)
    s.add_argument("--collective-rpc-method", action="append", default=[], metavar="NAME",
                   help="a worker method AsyncLLMEngine.collective_rpc may name (repeatable; default none)")
    s.add_argument("--model-dir", action="append", default=[], metavar="DIR",
                   help="client-made engines may load models from under DIR (repeatable; published models are too)")
    s.add_argument("--lora-dir", action="append", default=[], metavar="DIR",
                   help="LoRA adapters may be loaded from under DIR (repeatable; and from under the model dirs)")
    s.add_argument("--rendezvous-host", action="append", default=None, metavar="HOST",
                   help="process groups may meet at HOST (repeatable; default 127.0.0.1, localhost, ::1)")
    s.add_argument("--operator", action="append", default=[], metavar="IDENTITY",
                   help="a client identity that may change published engines for every client (pause, sleep, reset "
                        "caches, unload adapters); '*': every caller (repeatable; default none)")
    s.add_argument("--engine-arg-allowed", action="append", default=[], metavar="NAME",
                   help="an engine argument a client may set beyond the safe ones (repeatable)")
    s.add_argument("--max-engines-per-client", type=int, default=2, metavar="N",
                   help="engines one client may make on this worker, published ones aside (default %(default)s)")
    s.add_argument("--max-sessions", type=int, default=10_000, metavar="N", help="sessions (default %(default)s)")
    s.add_argument("--max-refs-per-client", type=int, default=100_000, metavar="N",
                   help="refs one client may hold (default %(default)s)")
    s.add_argument("--max-ref-bytes-per-client", type=int, default=1 << 30, metavar="N",
                   help="bytes of tensors one client's refs may hold (default %(default)s; 0: no limit)")
    s.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024, metavar="N",
                   help="the largest request (default %(default)s)")
    s.add_argument("--max-prompt-chars", type=int, default=1_000_000, metavar="N",
                   help="the longest prompt (default %(default)s)")
    s.add_argument("--outside-ranks", type=int, default=0, metavar="N",
                   help="ranks a client's process group may have beyond the pool's own (default %(default)s)")
    s.add_argument("--max-live-sequences", type=int, default=12_288, metavar="N",
                   help="sequences a published engine holds live, every client's; 0: no bound (default %(default)s)")
    s.add_argument("--grammar-compile-s", type=float, default=5.0, metavar="S",
                   help="how long a new structured-output grammar's trial (compiling it, generating under it, in "
                        "a process that can be stopped) may take; 0: not tried (default %(default)s)")
    s.add_argument("--unread-request-s", type=float, default=30.0, metavar="S",
                   help="a request nobody can read (add_request's) ends this long after it started; 0: never "
                        "(default %(default)s)")
    s.add_argument("--idle-engine-s", type=float, default=900.0, metavar="S",
                   help="without authentication, an engine a client made that no call has named for this long, "
                        "and that holds no live request, is released; 0: never (default %(default)s)")
    s.add_argument("--orphan-ref-s", type=float, default=3600.0, metavar="S",
                   help="without authentication, a ref whose maker's connection has closed, and that no call has "
                        "used for this long, is released; 0: never (default %(default)s)")
    s.add_argument("--reader-stall", type=float, default=READER_STALL_S, metavar="S",
                   help="a stream whose caller reads nothing for this long ends, freeing its slot; 0: never "
                        "(default %(default)s)")
    g = p.add_argument_group("distributed pools: join a torch.distributed group at start")
    g.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"])
    g.add_argument("--dist-world-size", type=int, default=1)
    g.add_argument("--dist-rank", type=int, default=0)
    g.add_argument("--dist-init", default=None, help="rendezvous address, e.g. tcp://127.0.0.1:29500")
    g.add_argument("--dist-tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--dist-pp", type=int, default=1, help="pipeline-parallel size")


def published_models(objects: list[dict[str, Any]]) -> list[str]:
    """The model folders the published objects load: client-made engines may load them too."""
    found = []
    for spec in objects:
        engine_args = (spec.get("kwargs") or {}).get("engine_args")
        if isinstance(engine_args, dict) and isinstance(engine_args.get("model"), str):
            found.append(engine_args["model"])
    return found


def security_from_args(args: argparse.Namespace) -> ServerSecurity:
    from bridge_server.wire.security import ServerSecurity
    return ServerSecurity.load(args.token_file, args.tls_cert, args.tls_key, args.tls_client_ca,
                               open_services=not args.auth_health)


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    from adapters.spec import Policy
    from bridge_server.worker.invoke import Limits
    from bridge_server.worker.server import DistributedRank, WorkerConfig
    for name in ("max_engines_per_client", "max_sessions", "max_refs_per_client", "max_ref_bytes_per_client",
                 "max_request_bytes",
                 "max_prompt_chars", "reader_stall", "outside_ranks", "unread_request_s", "grammar_compile_s",
                 "max_live_sequences", "idle_engine_s", "orphan_ref_s"):
        if getattr(args, name) < 0:
            raise SystemExit(f"vllm-bridge worker: --{name.replace('_', '-')} must be >= 0")
    objects = json.loads(args.objects)
    policy = Policy(collective_rpc_methods=frozenset(args.collective_rpc_method),
                    model_dirs=tuple(args.model_dir) + tuple(published_models(objects)),
                    lora_dirs=tuple(args.lora_dir), engine_args_allowed=frozenset(args.engine_arg_allowed),
                    max_prompt_chars=args.max_prompt_chars, operators=frozenset(args.operator),
                    outside_ranks=args.outside_ranks, unread_request_s=args.unread_request_s,
                    idle_engine_s=args.idle_engine_s, orphan_ref_s=args.orphan_ref_s,
                    max_live_sequences=args.max_live_sequences, grammar_compile_s=args.grammar_compile_s,
                    **({"rendezvous_hosts": frozenset(args.rendezvous_host)} if args.rendezvous_host else {}))
    dist = None
    if args.dist_backend:
        if not args.dist_init:
            raise SystemExit("vllm-bridge worker: --dist-backend needs --dist-init (the rendezvous address)")
        dist = DistributedRank(args.dist_backend, args.dist_world_size, args.dist_rank, args.dist_init,
                               args.dist_tp, args.dist_pp)
    return WorkerConfig(distributed=dist, listen=args.listen, worker_id=args.worker_id, session_cap=args.session_cap,
                        idle_ttl_s=args.ref_ttl, tensor_max_bytes=args.tensor_max_bytes, grace_s=args.grace,
                        objects=objects, lane=args.lane, warmup=args.warmup, security=security_from_args(args),
                        insecure=args.insecure, policy=policy,
                        limits=Limits(max_engines_per_client=args.max_engines_per_client,
                                      reader_stall_s=args.reader_stall or None),
                        max_sessions=args.max_sessions, max_refs_per_client=args.max_refs_per_client,
                        max_ref_bytes_per_client=args.max_ref_bytes_per_client,
                        max_request_bytes=args.max_request_bytes,
                        probe_interval_s=args.probe_interval, probe_timeout_s=args.probe_timeout,
                        min_ping_interval_s=args.min_ping_interval)


def _take_the_group_down(signum: int, frame: object) -> None:
    """SIGHUP: the server that started this worker died (PR_SET_PDEATHSIG), or the terminal of a
    worker started by hand hung up. Nobody is left to stop the worker's children (vLLM's engine
    cores), so the whole process group goes, this worker with it."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def main(args: argparse.Namespace) -> int:
    """Runs a worker until SIGTERM/SIGINT (or SIGHUP: see above); never returns normally."""
    if os.getpgrp() == os.getpid():   # a group of its own (as the supervisor starts it): only ours to kill
        signal.signal(signal.SIGHUP, _take_the_group_down)
    from adapters.process_groups import meet_at_loopback
    from bridge_server.worker.server import serve_worker
    try:
        config = config_from_args(args)
    except SecurityError as exc:
        print(f"vllm-bridge worker: {exc}", file=sys.stderr)
        return 2
    meet_at_loopback(config.policy.rendezvous_hosts)
    import vllm.logger  # noqa: F401  (its own handlers, which its loggers write to instead of the root's)
    budget_logs([logging.getLogger(), logging.getLogger("vllm")])
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0":   # engines compute in this process
        import adapters.engine_core
        adapters.engine_core.install()
    # uvloop by default: fewer syscalls and less Python per loop turn, which a streaming worker makes many of.
    try:
        eventloop.run(serve_worker(config, ready_file=args.ready_file), args.loop)
    except SecurityError as exc:
        print(f"vllm-bridge worker: {exc}", file=sys.stderr)
        return 2
    # The graceful stop is done. A call abandoned inside C code (a gloo wait, say) would otherwise
    # keep the interpreter joining its thread forever: a stopped worker must exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)
