"""The `vllm-bridge` commands that are clients of a running server: `call`, `describe --address`,
`release` and `status`. Results print as JSON (`wire/jsonvalue.py` spells what JSON lacks), errors as a
JSON object on stderr with exit status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from bridge_server.wire.options import STREAM_ENCODINGS, RuntimeOptions
from bridge_server.wire.protocol import GRPC_OPTIONS
from bridge_server.wire.security import channel, read_token, token_metadata
from vllm_bridge.v1 import bridge_pb2 as pb
from vllm_bridge.v1 import pool_pb2 as ppb
from vllm_bridge.v1 import pool_pb2_grpc as ppb_grpc

DEFAULT_ADDRESS = "127.0.0.1:50051"


def status_to_dict(reply: ppb.StatusReply) -> dict[str, Any]:
    """The status as plain JSON data: every field present, 64-bit counters as numbers (the proto JSON
    mapping would make them strings)."""
    data: dict[str, Any] = MessageToDict(reply, preserving_proto_field_name=True,
                                         always_print_fields_with_no_presence=True)
    for pool in data.get("pools", []):
        pool["restarts"] = int(pool["restarts"])
        for w in pool.get("workers", []):
            for key in ("calls", "refs"):
                w[key] = int(w[key])
    return data


def add_connection_options(p: argparse.ArgumentParser) -> None:
    """How a command reaches a server: its address, and the credentials a secured server asks for."""
    p.add_argument("--address", default=DEFAULT_ADDRESS)
    p.add_argument("--token-file", default=None, metavar="FILE",
                   help="send the bearer token in FILE (default: $VLLM_BRIDGE_TOKEN, if set)")
    p.add_argument("--tls-ca", default=None, metavar="FILE", help="speak TLS, trusting this CA (PEM)")
    p.add_argument("--tls-cert", default=None, metavar="FILE", help="mutual TLS: this client's certificate (PEM)")
    p.add_argument("--tls-key", default=None, metavar="FILE", help="... and its key (PEM)")


def client_of(args: argparse.Namespace, **options: Any) -> Any:
    """A BridgeClient from the connection options (imported here: it loads the value codec)."""
    from bridge_server.client.client import BridgeClient
    return BridgeClient(args.address, token=read_token(args.token_file), tls_ca=args.tls_ca, tls_cert=args.tls_cert,
                        tls_key=args.tls_key, **options)


def cmd_status(args: argparse.Namespace) -> int:
    try:   # a plain stub, not BridgeClient: `status` must not pay for importing the value codec (torch)
        with channel(args.address, GRPC_OPTIONS, args.tls_ca, args.tls_cert, args.tls_key) as ch:
            reply = ppb_grpc.PoolStub(ch).Status(ppb.StatusRequest(pool=args.pool), timeout=args.timeout,
                                                 metadata=token_metadata(read_token(args.token_file)))
    except grpc.RpcError as err:
        print(json.dumps({"error": {"code": err.code().name, "message": err.details()}}),  # type: ignore[attr-defined]
              file=sys.stderr)
        return 1
    json.dump(status_to_dict(reply), sys.stdout, indent=2)
    print()
    return 0


def cmd_describe(args: argparse.Namespace) -> int:
    with client_of(args) as client:
        print_catalog(client.describe(args.prefix))
    return 0


def print_catalog(catalog: pb.Catalog) -> None:
    json.dump(MessageToDict(catalog, preserving_proto_field_name=True), sys.stdout, indent=2)
    print()


def cmd_call(args: argparse.Namespace) -> int:
    from bridge_server.client.client import CallError, Target
    from bridge_server.wire.jsonvalue import from_json, to_json

    call_args = tuple(from_json(json.loads(a)) for a in args.args)
    kwargs = from_json(json.loads(args.kwargs)) if args.kwargs else {}
    if args.on:
        receiver: pb.Ref | str = pb.Ref(id=args.on[1:]) if args.on.startswith("$") else args.on
        target = Target.get(receiver, args.target) if args.get else Target.method(receiver, args.target)
    else:
        target = Target.fn(args.target)
    options = RuntimeOptions(session_id=args.session, timeout_profile=args.timeout_profile,
                             stream_timeout_s=args.stream_timeout / 1000 if args.stream_timeout else None,
                             pool=args.pool, affinity=args.affinity, stream_encoding=args.stream_encoding)
    timeout = args.timeout / 1000 if args.timeout else None
    with client_of(args, options=options) as client:
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
    from bridge_server.client.client import CallError
    with client_of(args) as client:
        try:
            print(json.dumps({"released": client.release(*args.refs, session_id=args.session or "")}))
        except CallError as err:
            print(json.dumps({"error": {"code": err.code.name, "message": err.details}}), file=sys.stderr)
            return 1
    return 0


def add_commands(sub: Any) -> None:
    """Adds `status`, `call` and `release` to the `vllm-bridge` parser (`describe` is shared with the
    worker's local catalog, so the top-level parser adds it)."""
    p = sub.add_parser("status", help="print a pool server's pools and workers as JSON")
    add_connection_options(p)
    p.add_argument("--pool", default="", help="only this pool")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("call", help="call a target and print each result as a JSON line")
    p.add_argument("target", help="a catalog name (vllm.distributed.divide), or a member name with --on")
    p.add_argument("args", nargs="*", help="positional arguments, one JSON value each")
    p.add_argument("--kwargs", default=None, help="keyword arguments as one JSON object")
    p.add_argument("--on", default=None, help="call a member of a published object NAME, or of a ref $ID")
    p.add_argument("--get", action="store_true", help="with --on: read the attribute instead of calling it")
    p.add_argument("--stream", action="store_true", help="stream the result item by item")
    p.add_argument("--stream-encoding", default=None, choices=list(STREAM_ENCODINGS),
                   help="how items travel (default: patch-v2, patches against the item before, with rows; "
                        "the same values print either way)")
    add_connection_options(p)
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
    add_connection_options(p)
    p.set_defaults(func=cmd_release)
