"""`vllm-bridge`: run a worker or the pool server, inspect the catalog, make a call from the shell,
build the tiny model or the Elixir bindings.

The one entry point of every role: each subcommand's options and code live with the role that runs
it (`worker/main.py`, `pool/config.py` and `pool/server.py`, `client/commands.py`, `tools/`), and are
imported only when that subcommand runs, so `vllm-bridge status` never pays for importing vLLM.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence

# Before gRPC is imported: our servers fork (the pool server its workers, a worker vLLM's engine
# core) while gRPC's threads are busy, and gRPC's fork handlers then skip their work and leave the
# child to crash (seen: a worker killed by SIGSEGV as it was spawned). Every child execs at once,
# so it needs none of them.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from bridge_server.client import commands as client_commands  # noqa: E402
from bridge_server.pool.config import add_serve_arguments  # noqa: E402
from bridge_server.wire.logbudget import budget_logs  # noqa: E402
from bridge_server.worker import main as worker_main  # noqa: E402

# vLLM must never try to reach a model hub or send usage data from our processes.
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                     ("DO_NOT_TRACK", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
    os.environ.setdefault(_key, _value)


def cmd_serve(args: argparse.Namespace) -> int:
    from bridge_server.pool.config import ConfigError, config_from_args
    from bridge_server.pool.server import run
    try:
        config = config_from_args(args, default_model=_tiny_model)
    except ConfigError as exc:
        print(f"vllm-bridge serve: {exc}", file=sys.stderr)
        return 2
    from bridge_server.wire.security import SecurityError
    try:
        rc = run(config, ready_file=args.ready_file, stdin_watch=args.stdin_watch)
    except SecurityError as exc:
        print(f"vllm-bridge serve: {exc}", file=sys.stderr)
        return 2
    logging.shutdown()
    sys.stdout.flush()
    os._exit(rc)   # every worker is stopped; do not wait on gRPC's threads


def _tiny_model() -> str:
    """The model of the built-in default pool: the offline tiny one, built on first use."""
    from bridge_server.tools.tiny_model import ensure_tiny_model
    return str(ensure_tiny_model())


def cmd_describe(args: argparse.Namespace) -> int:
    """The catalog of a running server, or, without --address, the one a worker here would build."""
    if args.address:
        return client_commands.cmd_describe(args)
    from bridge_server.worker.catalog import describe
    from bridge_server.worker.server import default_catalog
    catalog = describe(default_catalog())
    if args.prefix:
        kept = [e for e in catalog.entries if e.name.startswith(args.prefix)]
        del catalog.entries[:]
        catalog.entries.extend(kept)
    client_commands.print_catalog(catalog)
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from bridge_server.tools.tiny_model import main as tiny_main
    return tiny_main([args.dir, "--seed", str(args.seed)] + (["--lora", args.lora] if args.lora else []))


def cmd_gen_elixir(args: argparse.Namespace) -> int:
    from bridge_server.tools.elixir_gen import main as gen_main
    return gen_main((["--address", args.address] if args.address else []) + (["--out", args.out] if args.out else []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-bridge", description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run one worker process serving the Bridge protocol")
    worker_main.add_arguments(p)
    p.set_defaults(func=worker_main.main)

    p = sub.add_parser("serve", help="run the pool server: a router in front of worker processes")
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    client_commands.add_commands(sub)

    p = sub.add_parser("describe", help="print the catalog as JSON")
    client_commands.add_connection_options(p)
    p.set_defaults(address=None)     # no address: the catalog a worker here would build
    p.add_argument("--prefix", default="")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("make-tiny-model", help="build the small offline model (random weights, local tokenizer)")
    p.add_argument("dir", help="folder to write the model into")
    p.add_argument("--lora", default=None, help="also write a rank-8 LoRA adapter for it into this folder")
    p.add_argument("--seed", type=int, default=0)
    p.set_defaults(func=cmd_make_tiny_model)

    p = sub.add_parser("gen-elixir", help="generate the Elixir binding modules from the catalog")
    p.add_argument("--address", default=None, help="read the catalog from this server (default: build it here)")
    p.add_argument("--out", default=None, help="folder of the Vllm.* modules (default mix_client_example/lib/vllm)")
    p.set_defaults(func=cmd_gen_elixir)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # argparse stops collecting `call`'s positional arguments at the first option; the rest of them
    # come back as extras, which belong to the call when they are not options.
    args, extra = parser.parse_known_args(argv)
    if extra and args.command == "call" and not any(x.startswith("--") for x in extra):
        args.args += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("grpc._cython.cygrpc").addFilter(_caller_gone_mid_write)
    budget_logs([logging.getLogger()])
    return int(args.func(args))


def _caller_gone_mid_write(record: logging.LogRecord) -> bool:
    """gRPC logs an ERROR with a traceback when a reply's write fails because its caller went
    (closed its connection, or reset a stream it left unread): any client can make a server write
    those, as many as it likes, and they say nothing about the server. Kept at DEBUG."""
    if record.levelno >= logging.ERROR and str(record.msg).startswith("ExecuteBatchError raised in core"):
        record.levelno, record.levelname, record.exc_info, record.exc_text = logging.DEBUG, "DEBUG", None, None
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
    return True


if __name__ == "__main__":
    sys.exit(main())
elif __name__ == "__mp_main__":
    # A process spawned from ours re-imports this module as its main: vLLM's engine core, which makes
    # a process group of its own. Its store then listens only at the host it names, as the worker's do,
    # and its CPU paths get the fixes of `adapters.engine_core`.
    import adapters.engine_core
    import adapters.process_groups  # noqa: F401 - its import makes stores listen at their own host

    adapters.engine_core.install()
