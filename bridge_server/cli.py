"""`vllm-bridge`: run a worker or the server, inspect the catalog, make a call from the shell."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any

from bridge_server import eventloop

DEFAULT_ADDRESS = "127.0.0.1:50051"

# vLLM must never try to reach a model hub or send usage data from our processes.
for _key, _value in (("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
                     ("DO_NOT_TRACK", "1"), ("VLLM_CPU_KVCACHE_SPACE", "1")):
    os.environ.setdefault(_key, _value)


def _add_worker_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--listen", default=DEFAULT_ADDRESS, help="host:port or unix:/path (default %(default)s)")
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
    g = p.add_argument_group("distributed pools: join a torch.distributed group at start")
    g.add_argument("--dist-backend", default=None, choices=["gloo", "nccl"])
    g.add_argument("--dist-world-size", type=int, default=1)
    g.add_argument("--dist-rank", type=int, default=0)
    g.add_argument("--dist-init", default=None, help="rendezvous address, e.g. tcp://127.0.0.1:29500")
    g.add_argument("--dist-tp", type=int, default=1, help="tensor-parallel size")
    g.add_argument("--dist-pp", type=int, default=1, help="pipeline-parallel size")


def _worker_config(args: argparse.Namespace) -> Any:
    from bridge_server.worker import DistributedRank, WorkerConfig
    dist = None
    if args.dist_backend:
        if not args.dist_init:
            raise SystemExit("vllm-bridge worker: --dist-backend needs --dist-init (the rendezvous address)")
        dist = DistributedRank(args.dist_backend, args.dist_world_size, args.dist_rank, args.dist_init,
                               args.dist_tp, args.dist_pp)
    return WorkerConfig(distributed=dist, listen=args.listen, worker_id=args.worker_id, session_cap=args.session_cap,
                        idle_ttl_s=args.ref_ttl, tensor_max_bytes=args.tensor_max_bytes, grace_s=args.grace,
                        objects=json.loads(args.objects), lane=args.lane)


def _take_the_group_down(signum: int, frame: object) -> None:
    """SIGHUP: the server that started this worker died (PR_SET_PDEATHSIG), or the terminal of a
    worker started by hand hung up. Nobody is left to stop the worker's children (vLLM's engine
    cores), so the whole process group goes, this worker with it."""
    os.killpg(os.getpgrp(), signal.SIGKILL)


def cmd_worker(args: argparse.Namespace) -> int:
    if os.getpgrp() == os.getpid():   # a group of its own (as the supervisor starts it): only ours to kill
        signal.signal(signal.SIGHUP, _take_the_group_down)
    from bridge_server.worker import serve_worker
    # uvloop by default: fewer syscalls and less Python per loop turn, which a streaming worker makes many of.
    eventloop.run(serve_worker(_worker_config(args), ready_file=args.ready_file), args.loop)
    # The graceful stop is done. A call abandoned inside C code (a gloo wait, say) would otherwise
    # keep the interpreter joining its thread forever: a stopped worker must exit.
    logging.shutdown()
    sys.stdout.flush()
    os._exit(0)


def cmd_serve(args: argparse.Namespace) -> int:
    from bridge_server.config import ConfigError, config_from_args
    from bridge_server.server import run
    try:
        config = config_from_args(args)
    except ConfigError as exc:
        print(f"vllm-bridge serve: {exc}", file=sys.stderr)
        return 2
    rc = run(config, ready_file=args.ready_file)
    logging.shutdown()
    sys.stdout.flush()
    os._exit(rc)   # every worker is stopped; do not wait on gRPC's threads


def cmd_status(args: argparse.Namespace) -> int:
    import grpc

    from bridge_server.server import fetch_status, status_to_dict
    try:
        reply = asyncio.run(fetch_status(args.address, args.pool, args.timeout))
    except grpc.RpcError as err:
        print(json.dumps({"error": {"code": err.code().name, "message": err.details()}}),  # type: ignore[attr-defined]
              file=sys.stderr)
        return 1
    json.dump(status_to_dict(reply), sys.stdout, indent=2)
    print()
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    from google.protobuf.json_format import MessageToDict
    if args.address:
        from bridge_server.client import BridgeClient
        with BridgeClient(args.address) as client:
            catalog = client.describe(args.prefix)
    else:
        from bridge_server.describe import describe
        from bridge_server.worker import default_catalog
        catalog = describe(default_catalog())
        if args.prefix:
            kept = [e for e in catalog.entries if e.name.startswith(args.prefix)]
            del catalog.entries[:]
            catalog.entries.extend(kept)
    json.dump(MessageToDict(catalog, preserving_proto_field_name=True), sys.stdout, indent=2)
    print()
    return 0


def cmd_call(args: argparse.Namespace) -> int:
    from bridge_server.client import BridgeClient, CallError, Target
    from bridge_server.jsonvalue import from_json, to_json
    from bridge_server.protocol import RuntimeOptions
    from vllm_bridge.v1 import bridge_pb2 as pb

    call_args = tuple(from_json(json.loads(a)) for a in args.args)
    kwargs = from_json(json.loads(args.kwargs)) if args.kwargs else {}
    if args.on:
        receiver: pb.Ref | str = pb.Ref(id=args.on[1:]) if args.on.startswith("$") else args.on
        target = Target.get(receiver, args.target) if args.get else Target.method(receiver, args.target)
    else:
        target = Target.fn(args.target)
    options = RuntimeOptions(session_id=args.session, timeout_profile=args.timeout_profile,
                             stream_timeout_s=args.stream_timeout / 1000 if args.stream_timeout else None,
                             pool=args.pool, affinity=args.affinity)
    timeout = args.timeout / 1000 if args.timeout else None
    with BridgeClient(args.address, options=options) as client:
        try:
            if args.stream:
                for item in client.stream(target, *call_args, kwargs=kwargs, timeout=timeout):
                    print(json.dumps(to_json(item)), flush=True)
            else:
                print(json.dumps(to_json(client.call(target, *call_args, kwargs=kwargs, timeout=timeout))))
        except CallError as err:
            detail = err.detail
            print(json.dumps({"error": {"code": err.code.name, "message": err.details,
                                        "category": detail.category if detail else "",
                                        "python_type": detail.python_type if detail else "",
                                        "reason": detail.reason if detail else ""}}), file=sys.stderr)
            return 1
    return 0


def cmd_release(args: argparse.Namespace) -> int:
    from bridge_server.client import BridgeClient
    with BridgeClient(args.address) as client:
        print(json.dumps({"released": client.release(*args.refs, session_id=args.session or "")}))
    return 0


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from bridge_server.tiny_model import main as tiny_main
    return tiny_main([args.dir, "--seed", str(args.seed)] + (["--lora", args.lora] if args.lora else []))


def cmd_gen_elixir(args: argparse.Namespace) -> int:
    from bridge_server.elixir_gen import main as gen_main
    return gen_main((["--address", args.address] if args.address else []) + (["--out", args.out] if args.out else []))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-bridge", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("worker", help="run one worker process serving the Bridge protocol")
    _add_worker_options(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("serve", help="run the pool server: a router in front of worker processes")
    from bridge_server.config import add_serve_arguments
    add_serve_arguments(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("status", help="print a pool server's pools and workers as JSON")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--pool", default="", help="only this pool")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("describe", help="print the catalog as JSON")
    p.add_argument("--address", default=None, help="ask this server instead of building the catalog locally")
    p.add_argument("--prefix", default="")
    p.set_defaults(func=cmd_describe)

    p = sub.add_parser("call", help="call a target and print each result as a JSON line")
    p.add_argument("target", help="a catalog name (vllm.distributed.divide), or a member name with --on")
    p.add_argument("args", nargs="*", help="positional arguments, one JSON value each")
    p.add_argument("--kwargs", default=None, help="keyword arguments as one JSON object")
    p.add_argument("--on", default=None, help="call a member of a published object NAME, or of a ref $ID")
    p.add_argument("--get", action="store_true", help="with --on: read the attribute instead of calling it")
    p.add_argument("--stream", action="store_true", help="stream the result item by item")
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--session", default="cli")
    p.add_argument("--timeout", type=float, default=None, help="deadline in milliseconds")
    p.add_argument("--timeout-profile", default=None, choices=["default", "ml_inference", "batch_job", "streaming"])
    p.add_argument("--stream-timeout", type=float, default=None, help="idle ms allowed between stream items")
    p.add_argument("--pool", default=None)
    p.add_argument("--affinity", default=None, choices=["hint", "strict_queue", "strict_fail_fast"])
    p.set_defaults(func=cmd_call)

    p = sub.add_parser("release", help="release refs and/or a session")
    p.add_argument("refs", nargs="*")
    p.add_argument("--session", default=None)
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.set_defaults(func=cmd_release)

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
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
