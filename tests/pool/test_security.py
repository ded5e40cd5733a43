"""The trust boundary, over real sockets: only the documented surface is reachable, nothing a client
sends is unpickled or run, tokens and (mutual) TLS guard the ports, sessions and refs belong to the
client that made them, and every limit holds. Escapes run against `stranger_server` (its engine);
authentication, TLS and limits against servers of their own, started here."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import pickle
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bridge_server.client.client import BridgeClient, CallError, Target
from bridge_server.tools.tiny_model import ensure_tiny_model
from bridge_server.wire.errors import BridgeError
from tests.conftest import ROOT, free_port
from tests.pool.harness import PoolServer, others_calling, start_pool_server, toml_inline
from tests.worker.test_engine import engine_args
from vllm_bridge.v1 import bridge_pb2 as pb

D = "vllm.distributed"
E = "vllm.AsyncLLMEngine"
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def server(stranger_server: PoolServer) -> PoolServer:
    return stranger_server


@pytest.fixture()
def client(server: PoolServer) -> Iterator[BridgeClient]:
    with server.client(pool="e") as c:
        yield c


def denied(call: Any) -> CallError:
    with pytest.raises(CallError) as err:
        call()
    assert err.value.code == DENIED, err.value
    return err.value


# ------------------------------------------------------------------------------------------ escapes
class _Touch:
    """A pickle that, once loaded, creates a file: what an attacker sends to run code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.path}",))


@pytest.mark.parametrize("walk", [("engine_core",), ("output_processor",), ("input_processor",),
                                  ("engine_core", "resources"), ("vllm_config",), ("__class__",), ("__dict__",),
                                  ("__init__",)])
def test_members_outside_the_documents_are_unreachable(client: BridgeClient, walk: tuple[str, ...]) -> None:
    err = denied(lambda: client.call(Target.get("engine", walk[0]), timeout=10))
    assert walk[0] in err.details and "vllm.v1.engine.async_llm.AsyncLLM" in err.details
    denied(lambda: client.call(Target.method("engine", walk[0]), timeout=10))


@pytest.mark.parametrize("qualname", ["vllm.envs.os", "vllm.v1.serial_utils.pickle", "vllm.__builtins__",
                                      "vllm.envs", "os.system", "vllm.distributed.parallel_state.GroupCoordinator"])
def test_resolving_a_name_reaches_only_the_catalog(client: BridgeClient, qualname: str) -> None:
    err = denied(lambda: client.call(f"{D}.resolve_obj_by_qualname", qualname, timeout=10))
    assert "not a name in the catalog" in err.details


def test_code_the_catalog_names_can_be_named_never_passed(client: BridgeClient) -> None:
    divide = client.call(f"{D}.resolve_obj_by_qualname", f"{D}.divide", timeout=10)
    assert isinstance(divide, pb.Ref) and divide.type_name == "builtins.function"
    err = denied(lambda: client.call(f"{D}.divide", divide, 3, timeout=10))
    assert "never passed as an argument" in err.details
    assert err.detail is not None and err.detail.parameter == "args[0]", err      # where it was, not the ref's id
    denied(lambda: client.call(Target.method(divide, "__call__"), 6, 3, timeout=10))
    assert client.release(divide) == 1
    # A documented method can be called, not taken: reading it would hand out a bound method (and
    # from there its function's globals). The read is refused for its kind, before anything runs.
    with pytest.raises(CallError) as read:
        client.call(Target.get("engine", "_add_request"), timeout=10)
    assert read.value.code == grpc.StatusCode.INVALID_ARGUMENT, read.value
    assert "_add_request is a method, not an attribute: use METHOD" in read.value.details, read.value


def test_a_published_engine_cannot_be_shut_down_by_a_client(client: BridgeClient) -> None:
    err = denied(lambda: client.call(Target.method("engine", "shutdown"), timeout=10))
    assert "published" in err.details
    assert client.call(Target.method("engine", "check_health"), timeout=10) is None


def test_a_path_is_taken_only_as_the_absolute_path_that_is_checked(client: BridgeClient) -> None:
    """vLLM reads `~/x` as a home folder and `org/name` as a model hub's id, where the check had read
    both against the server's folder: `~/adapter` loaded an adapter from outside the allowed folders
    on a server run from inside one. Only an absolute path is taken, whatever it would resolve to."""
    lora = ensure_tiny_model() / "lora"
    root = Path(__file__).resolve().parents[2]            # the pool server's folder
    for path in (os.path.relpath(lora, root), "~/lora", "org/name"):
        err = denied(lambda: client.call("vllm.lora.request.LoRARequest", "x", 1, path, timeout=10))
        assert "field lora_path: expected an absolute path" in err.details, err.details
        err = denied(lambda: client.call(f"{E}.from_engine_args", {"model": path}, timeout=30))
        assert "field model: expected an absolute path" in err.details, err.details
    assert isinstance(client.call("vllm.lora.request.LoRARequest", "x", 1, str(lora), timeout=10), pb.Ref)


def test_a_parameter_that_takes_a_function_takes_nothing_a_client_holds(client: BridgeClient) -> None:
    """Code is named, never passed; an object a client holds that merely has `__call__` (the shared
    tokenizer) reached `direct_register_custom_op`, which registers its op for the whole process, and
    stopped only at torch's schema inference. A parameter annotated as a function takes none."""
    tokenizer = client.call(Target.get("engine", "tokenizer"), timeout=10)
    with pytest.raises(CallError) as err:
        client.call(f"{D}.direct_register_custom_op", "bridge_test_op", tokenizer, timeout=10)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
    assert "parameter op_func" in err.value.details and "a client cannot pass" in err.value.details, err.value
    assert client.call(Target.method("engine", "check_health"), timeout=10) is None


@pytest.mark.parametrize("case", [
    ("trust_remote_code", {"model": "MODEL", "trust_remote_code": True}, "engine_args_allowed"),
    ("worker_cls", {"model": "MODEL", "worker_cls": "os.system"}, "engine_args_allowed"),
    ("a model elsewhere", {"model": "/etc"}, "model_dirs"),
    ("a tokenizer elsewhere", {"model": "MODEL", "tokenizer": "/tmp"}, "model_dirs"),
], ids=lambda c: c[0])
def test_engine_arguments_that_run_code_or_read_elsewhere_are_refused(client: BridgeClient,
                                                                       case: tuple[str, dict[str, Any], str]) -> None:
    _, args, names = case
    args = {k: str(ensure_tiny_model()) if v == "MODEL" else v for k, v in args.items()}
    t0 = time.monotonic()
    err = denied(lambda: client.call(f"{E}.from_engine_args", args, timeout=30))
    assert names in err.details and time.monotonic() - t0 < 5      # refused before any engine starts
    denied(lambda: client.call("vllm.AsyncEngineArgs", kwargs=args, timeout=30))


def test_records_take_only_what_a_client_may_set(client: BridgeClient) -> None:
    err = denied(lambda: client.call("vllm.config.ParallelConfig", kwargs={"worker_cls": "os.system"}, timeout=10))
    assert "worker_cls" in err.details
    denied(lambda: client.call("vllm.config.VllmConfig", kwargs={"model_config": {}}, timeout=10))
    err = denied(lambda: client.call("vllm.lora.request.LoRARequest", "x", 1, "/etc", timeout=10))
    assert "lora_dirs" in err.details
    lora = str(ensure_tiny_model() / "lora")
    assert isinstance(client.call("vllm.lora.request.LoRARequest", "x", 1, lora, timeout=10), pb.Ref)
    denied(lambda: client.call("vllm.SamplingParams", kwargs={"logits_processors": ["os.system"]}, timeout=10))


def record(type_name: str, **fields: Any) -> Any:
    """An instance the client encodes as a Record of `type_name`: what a client in any language can
    send, whatever classes it has."""
    module, _, name = type_name.rpartition(".")
    cls = dataclasses.make_dataclass(name, list(fields))
    cls.__module__ = module
    return cls(**fields)


def test_a_record_is_checked_like_a_map_and_no_remote_code_runs(client: BridgeClient, tmp_path: Path) -> None:
    """A Record of an allow-listed class is not a way around what a map of it may set: the same
    rules, before any of the class's own code sees the fields."""
    evil = tmp_path / "evil_model"
    shutil.copytree(ensure_tiny_model(), evil)
    marker = tmp_path / "pwned"
    (evil / "configuration_pwn.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    config = json.loads((evil / "config.json").read_text())
    (evil / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoConfig": "configuration_pwn.C"}}))
    args = "vllm.engine.arg_utils.AsyncEngineArgs"
    for fields, names in (({"model": str(evil), "trust_remote_code": True}, "trust_remote_code"),
                          ({"model": str(ensure_tiny_model()), "trust_remote_code": True}, "trust_remote_code"),
                          ({"model": str(evil)}, "model_dirs")):
        err = denied(lambda: client.call(f"{E}.from_engine_args", record(args, **fields), timeout=30))
        assert names in err.details and "from_engine_args" in err.details, err.details
    lora = record("vllm.lora.request.LoRARequest", lora_name="x", lora_int_id=1, lora_path="/etc")
    err = denied(lambda: list(client.stream(Target.method("engine", "generate"), "Hi", {"max_tokens": 2}, "rec-lora",
                                            kwargs={"lora_request": lora}, timeout=30)))
    assert "lora_dirs" in err.details
    for where, call in (("lora_path", lambda p: list(client.stream(
            Target.method("engine", "generate"), "Hi", {"max_tokens": 2}, "nul-lora", timeout=30, kwargs={
                "lora_request": record("vllm.lora.request.LoRARequest", lora_name="x", lora_int_id=1, lora_path=p)}))),
                        ("model", lambda p: client.call(f"{E}.from_engine_args", record(args, model=p), timeout=30))):
        with pytest.raises(CallError) as nul:       # realpath raised ValueError: INTERNAL, naming nothing
            call(str(ensure_tiny_model()) + "/\0")
        assert nul.value.code == grpc.StatusCode.INVALID_ARGUMENT, nul.value
        assert f"field {where}: expected a path, got text holding a NUL character" in nul.value.details, nul.value
    err = denied(lambda: client.call(f"{D}.divide", record("vllm.config.parallel.ParallelConfig",
                                                             worker_cls="os.system"), 1, timeout=10))
    assert "worker_cls" in err.details
    with pytest.raises(CallError) as bad:       # a field the class does not have: named, not ignored
        client.call(f"{D}.divide", record("vllm.sampling_params.SamplingParams", max_tokenz=3), 1, timeout=10)
    assert bad.value.code == grpc.StatusCode.INVALID_ARGUMENT and "max_tokenz" in bad.value.details
    time.sleep(0.5)
    assert not marker.exists()


def test_a_published_engine_is_changed_only_by_an_operator(client: BridgeClient) -> None:
    """Pausing, putting to sleep, resetting caches or unloading adapters of the engine every client
    shares is an operator's act (none here); a client's own requests and reads stay open."""
    for method, args in (("pause_generation", ()), ("resume_generation", ()), ("sleep", ()), ("wake_up", ()),
                         ("reset_prefix_cache", (True,)), ("reset_mm_cache", ()), ("remove_lora", (1,)),
                         ("pin_lora", (1,)), ("start_profile", ()), ("scale_elastic_ep", (2,)),
                         ("wait_for_requests_to_drain", ()), ("_run_output_handler", ())):
        err = denied(lambda: client.call(Target.method("engine", method), *args, timeout=10))
        assert err.reason == "published" and "operators" in err.details, (method, err.details)
    err = denied(lambda: client.call(Target.set("engine", "tokenizer"), None, timeout=10))
    assert err.reason == "published"
    assert client.call(Target.method("engine", "is_paused"), timeout=10) is False
    assert client.call(Target.method("engine", "check_health"), timeout=10) is None
    items = list(client.stream(Target.method("engine", "generate"), "Hi", {"max_tokens": 2}, "still-open", timeout=30))
    assert items[-1]["finished"]


def test_every_entry_that_takes_text_bounds_it(server: PoolServer, client: BridgeClient) -> None:
    """`add_request` takes a prompt as `generate` does, with the same limits; and no string of any
    parameter may be longer than max_prompt_chars (tokenizing costs memory and time in proportion)."""
    over = "hello world " * 90_000       # 1,080,000 characters: over max_prompt_chars (1,000,000)
    tokenizer = client.call(Target.method("engine", "get_tokenizer"), timeout=10)
    for call in (lambda: client.call(Target.method("engine", "add_request"), "ar-over", over, {"max_tokens": 2},
                                     timeout=30),
                 lambda: client.call(Target.method(tokenizer, "encode"), over, timeout=30),
                 lambda: client.call(f"{D}.divide", {"x": [over]}, 1, timeout=30)):
        with pytest.raises(CallError) as err:
            call()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_prompt_chars" in err.value.details
    # The same bound holds the items of any list or map: 50 million packed ints kept a worker's event
    # loop busy for 25 s. (A request of 8 MB: within max_request_bytes, 64 MiB.)
    many = list(range(1024)) * 1000           # 1,024,000 ids, each within the vocabulary
    for field, value, what in (("allowed_token_ids", many, "a list of 1,024,000 items"),
                               ("logit_bias", dict.fromkeys(range(1_000_001), 0.5), "a map of 1,000,001 items")):
        with pytest.raises(CallError) as err:
            client.call("vllm.SamplingParams", kwargs={field: value}, timeout=30)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_prompt_chars" in err.value.details
        assert what in err.value.details, err.value.details
    # ... in all, not only in each: many lists each within the bound are over it together.
    with pytest.raises(CallError) as err:
        client.call("vllm.SamplingParams", kwargs={"extra_args": {f"k{i}": [0] * 600_000 for i in range(2)}},
                    timeout=30)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "items in all" in err.value.details
    t0 = time.monotonic()
    with pytest.raises(CallError) as err:
        client.call(Target.method("engine", "add_request"), "ar-long", over[:900_000], {"max_tokens": 2}, timeout=30)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "cannot fit" in err.value.details
    assert time.monotonic() - t0 < 5
    collector = client.call(Target.method("engine", "add_request"), "ar-ok", "Hi", {"max_tokens": 2}, timeout=30)
    assert isinstance(collector, pb.Ref)
    client.call(Target.method("engine", "abort"), "ar-ok", timeout=10)
    client.release(collector)


def test_tokenizer_work_of_a_request_is_bounded_and_off_the_event_loop(server: PoolServer,
                                                                          client: BridgeClient) -> None:
    generate = Target.method("engine", "generate")
    for key, count in (("bad_words", 4097), ("stop", 257)):
        with pytest.raises(CallError) as err:
            list(client.stream(generate, "Hi", {"max_tokens": 2, key: [f"w{i}" for i in range(count)]}, f"many-{key}",
                               timeout=30))
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and key in err.value.details
    with others_calling(server, "e") as slowest:     # as many characters as a request may give, in 500 words
        words = [f"word{i} " + "other " * 40 for i in range(500)]  # (more cost every engine step: step_cost_us)
        items = list(client.stream(generate, "Hi", {"max_tokens": 2, "bad_words": words}, "bad-words", timeout=60))
    assert items[-1]["finished"]
    assert slowest and max(slowest) < 1.0, max(slowest)


def test_call_options_are_bounded_as_grpc_bounds_headers(client: BridgeClient) -> None:
    """A Multiplex start carries its options in the message, where gRPC's header limit does not
    apply: the same bound holds there, so a session id cannot be a megabyte the servers remember."""
    with client.multiplex() as mux:
        for session, code in (("s" * 300, grpc.StatusCode.INVALID_ARGUMENT),
                              ("s" * (1 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED)):
            with pytest.raises(CallError) as err:
                mux.call(f"{D}.divide", 6, 3, session_id=session, timeout=10)
            assert err.value.code == code and "x-bridge-session" in err.value.details or "metadata" in err.value.details
        assert mux.call(f"{D}.divide", 6, 3, session_id="s" * 256, timeout=10) == 2


def test_process_groups_meet_only_where_the_operator_allows(client: BridgeClient, tmp_path: Path) -> None:
    t0 = time.monotonic()
    err = denied(lambda: client.call(f"{D}.stateless_init_torch_distributed_process_group", "203.0.113.7",
                                     free_port(), 0, 2, "gloo", timeout=10))
    assert "rendezvous_hosts" in err.details and time.monotonic() - t0 < 5
    # an allowed name with a blank passed once, and torch's store then listened on every interface
    for host in (" 127.0.0.1", "localhost ", "127.0.0.1\t"):
        t0 = time.monotonic()
        err = denied(lambda: client.call(f"{D}.stateless_init_torch_distributed_process_group", host, free_port(),
                                         0, 1, "gloo", timeout=10))
        assert err.reason == "host not allowed" and time.monotonic() - t0 < 5, (host, err.details)
    for method in ("tcp://203.0.113.7:1234", "TCP://203.0.113.7:1234", "  tcp://203.0.113.7:1234", "file:///tmp/x",
                   "FILE:///tmp/x", "tcp://:1234", "gloo://203.0.113.7"):
        err = denied(lambda: client.call(f"{D}.init_distributed_environment", 2, 0, method, timeout=10))
        assert err.reason in ("host not allowed", "init method not allowed"), (method, err.details)
    precious = tmp_path / "precious.txt"     # torch's file store would read it as its own, and delete it
    precious.write_text("precious data\n")
    denied(lambda: client.call(f"{D}.init_distributed_environment", 1, 0, f"file://{precious}", 0, "gloo",
                               timeout=10))
    assert precious.read_text() == "precious data\n"


def reachable(client: BridgeClient, receiver: Any, name: str) -> bool:
    """Whether the member is within the surface: anything but a "not documented" refusal."""
    try:
        client.call(Target.get(receiver, name), timeout=10)
    except CallError as err:
        return not (err.code == DENIED and err.reason == "not documented")
    return True


def test_a_walk_over_every_reachable_object_finds_nothing_outside_the_declared_set(client: BridgeClient) -> None:
    """Every name `dir()` shows on each kind of object a client can reach through the documented
    surface is tried: only the declared ones (documented members, an adapter's exposures, the
    context-manager protocol) are within reach."""
    from transformers import PreTrainedTokenizerFast
    from vllm.config import ParallelConfig, VllmConfig
    from vllm.forward_context import DPMetadata
    from vllm.v1.engine.async_llm import AsyncLLM

    from adapters.async_llm import ASYNC_LLM
    from adapters.forward_context import DP_METADATA, FORWARD_CONTEXT
    from adapters.surface import load_surfaces

    surfaces = load_surfaces()
    documented = {AsyncLLM: {e.name for e in surfaces[ASYNC_LLM.surface].entries},
                  DPMetadata: {e.name for e in surfaces[DP_METADATA.surface].entries}}
    exposed = {x.attr: x for spec in (ASYNC_LLM, FORWARD_CONTEXT) for x in spec.exposures}
    pc = client.call("vllm.config.ParallelConfig", timeout=10)
    receivers: list[tuple[Any, type, set[str]]] = [
        ("engine", AsyncLLM, documented[AsyncLLM]),
        (client.call(Target.method("engine", "get_tokenizer"), timeout=10), PreTrainedTokenizerFast,
         set(exposed["PreTrainedTokenizerBase"].attributes)),
        (pc, ParallelConfig, set(ParallelConfig.__dataclass_fields__) | set(exposed["ParallelConfig"].attributes)),
        (client.call("vllm.config.VllmConfig", timeout=10), VllmConfig, set(VllmConfig.__dataclass_fields__)),
        (client.call("vllm.forward_context.DPMetadata", __import__("torch").tensor(7),
                     __import__("torch").tensor([5, 7, 3]), timeout=10), DPMetadata, documented[DPMetadata]),
        (client.call(f"{D}.init_logger", "walk", timeout=10), object, set()),
        (client.call("vllm.forward_context.current_platform", timeout=10), object, set()),
    ]
    extra = {"engine_core", "output_processor", "input_processor", "output_handler", "logger_manager", "resources",
             "processes", "stats", "__dict__", "__globals__", "__builtins__", "__code__", "__self__", "__func__"}
    walked, outside = 0, []
    for receiver, cls, declared in receivers:
        assert isinstance(receiver, (pb.Ref, str)), receiver
        for name in sorted(set(dir(cls)) | extra):
            walked += 1
            public = {n for n in declared if not n.startswith("_") or n in documented.get(cls, ())}
            if reachable(client, receiver, name) != (name in public):
                outside.append(f"{cls.__qualname__}.{name}")
    assert walked > 500 and not outside, outside


# ------------------------------------------------------------------------------------------ TLS
def _pem(obj: Any) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return obj.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _cert(name: str, issuer: tuple[x509.Certificate, Any] | None, ca: bool = False,
          sans: tuple[str, ...] = ()) -> tuple[x509.Certificate, Any]:
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (x509.CertificateBuilder().subject_name(subject)
               .issuer_name(issuer[0].subject if issuer else subject).public_key(key.public_key())
               .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if sans:
        import ipaddress
        builder = builder.add_extension(x509.SubjectAlternativeName(
            [x509.IPAddress(ipaddress.ip_address(s)) if s[0].isdigit() else x509.DNSName(s) for s in sans]),
            critical=False)
    return builder.sign(issuer[1] if issuer else key, hashes.SHA256()), key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """A CA, a certificate for 127.0.0.1 and localhost, and a client certificate (CN alice)."""
    d = tmp_path_factory.mktemp("pki")
    ca = _cert("vllm-bridge test CA", None, ca=True)
    files = {"ca": ca[0], "server": _cert("server", ca, sans=("127.0.0.1", "localhost")),
             "client": _cert("alice", ca)}
    out = {}
    for name, value in files.items():
        cert, key = value if isinstance(value, tuple) else (value, None)
        (d / f"{name}.pem").write_bytes(_pem(cert))
        out[name] = str(d / f"{name}.pem")
        if key is not None:
            (d / f"{name}.key").write_bytes(_pem(key))
            out[f"{name}_key"] = str(d / f"{name}.key")
    out["ca"] = str(d / "ca.pem")
    return out


TOKENS = "alice:alice-token-0123456789abcdef\nbob:bob-token-0123456789abcdef0\n"


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, str]) -> Iterator[PoolServer]:
    """TLS, tokens and small limits: pool `p` (one worker, no engine); pool `g` (one worker, a
    published engine, alice its operator, requests nobody can read ended after a second, new
    grammars not tried first: what reaches the engine core is bounded there too)."""
    tmp = tmp_path_factory.mktemp("secured")
    (tmp / "tokens").write_text(TOKENS)
    (tmp / "tokens").chmod(0o600)
    config = f"""
token_file = "{tmp / 'tokens'}"
tls_cert = "{pki['server']}"
tls_key = "{pki['server_key']}"
max_request_bytes = 65536
[[pools]]
name = "p"
workers = 1
max_sessions = 4
max_refs_per_client = 5
max_ref_bytes_per_client = 40000

[[pools]]
name = "g"
workers = 1
max_engines_per_client = 1
model_dirs = ["{ensure_tiny_model()}"]
operators = ["alice"]
unread_request_s = 1
grammar_compile_s = 0
[[pools.objects]]
name = "engine"
target = "vllm.AsyncLLMEngine.from_engine_args"
kwargs = {toml_inline({"engine_args": engine_args(ensure_tiny_model())})}
"""
    s = start_pool_server(tmp, config, tls_ca=pki["ca"], token=TOKENS.split("\n")[0].partition(":")[2])
    yield s
    s.stop()


def client_as(server: PoolServer, pki: dict[str, str], who: str | None, **options: Any) -> BridgeClient:
    tokens = dict(line.split(":") for line in TOKENS.split())
    return BridgeClient(server.address, token=tokens[who] if who else "", tls_ca=pki["ca"], **options)


def test_every_call_needs_a_listed_token_but_health(secured: PoolServer, pki: dict[str, str]) -> None:
    for who in (None, "mallory"):
        with BridgeClient(secured.address, token=None if who is None else "mallory-token-0123456789",
                          tls_ca=pki["ca"]) as c:
            if who is None:
                c._credentials = []
            for call in (lambda: c.call(f"{D}.divide", 6, 3, timeout=10), lambda: c.describe(),
                         lambda: list(c.stream(f"{D}.get_pp_indices", 32, 0, 2, timeout=10)),
                         lambda: c.multiplex().call(f"{D}.divide", 6, 3)):
                with pytest.raises(CallError) as err:
                    call()
                assert err.value.code == grpc.StatusCode.UNAUTHENTICATED, err.value
    with client_as(secured, pki, "alice") as c:
        assert c.call(f"{D}.divide", 6, 3, timeout=10) == 2
        with c.multiplex() as mux:
            assert mux.call(f"{D}.divide", 8, 2) == 4
    creds = grpc.ssl_channel_credentials(Path(pki["ca"]).read_bytes())
    with grpc.secure_channel(secured.address, creds) as ch:   # health stays open: no token
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING


def test_plain_text_does_not_reach_a_tls_port(secured: PoolServer) -> None:
    with BridgeClient(secured.address, token="alice-token-0123456789abcdef") as c:
        with pytest.raises(CallError) as err:
            c.call(f"{D}.divide", 6, 3, timeout=5)
    assert err.value.code == grpc.StatusCode.UNAVAILABLE


def test_sessions_and_refs_belong_to_their_client(secured: PoolServer, pki: dict[str, str]) -> None:
    with client_as(secured, pki, "alice", options=None) as alice, client_as(secured, pki, "bob") as bob:
        ref = alice.call("vllm.config.ParallelConfig", kwargs={"data_parallel_size": 2}, session_id="shared-name")
        # Within one identity a ref passes between sessions (Elixir processes).
        assert alice.call(Target.get(ref, "data_parallel_size"), session_id="another") == 2
        for call in (lambda: bob.call(Target.get(ref, "data_parallel_size")),
                     lambda: bob.call("vllm.forward_context.DPMetadata.make", ref, 7, [5, 7]),
                     lambda: bob.release(ref)):
            err = denied(call)
            assert "belongs to another client" in err.details
        # The same session name is two sessions: bob releasing his frees nothing of alice's.
        bob.call("vllm.config.ParallelConfig", session_id="shared-name")
        assert bob.release(session_id="shared-name") == 1
        assert alice.call(Target.get(ref, "data_parallel_size")) == 2
        # Naming another identity in metadata changes nothing: the pool server says who calls.
        spoof = pb.CallRequest(target=pb.Target(kind=pb.Target.GET_ATTR, name="data_parallel_size", ref=ref))
        with pytest.raises(grpc.RpcError) as rpc:
            bob.stub.Call(spoof, metadata=bob._metadata([], {}) + [("x-bridge-identity", "alice")], timeout=10)
        assert rpc.value.code() == DENIED   # type: ignore[attr-defined]
        assert alice.release(session_id="shared-name") == 1


def test_one_identity_cannot_tell_from_the_prefix_cache_what_another_sent(secured: PoolServer,
                                                                           pki: dict[str, str]) -> None:
    """The published engine's prefix cache is every client's: `num_cached_tokens` told bob whether
    alice had sent a prompt (0 before, 128 after). Each identity's prompts are salted apart; its own
    repeats still hit the cache, and so does a prompt map that brings a salt of its own."""
    generate = Target.method("engine", "generate")
    secret = {"prompt_token_ids": [(7 * i) % 900 + 5 for i in range(200)]}

    def cached(who: BridgeClient, prompt: Any, rid: str) -> int:
        out = list(who.stream(generate, prompt, {"max_tokens": 1}, rid, pool="g", timeout=60))
        return int(out[-1]["num_cached_tokens"])

    with client_as(secured, pki, "alice") as alice, client_as(secured, pki, "bob") as bob:
        assert cached(alice, secret, "salt-a1") == 0
        assert cached(alice, secret, "salt-a2") > 0               # alice's own repeat: from the cache
        assert cached(bob, secret, "salt-b1") == 0                # bob learns nothing of alice's
        assert cached(bob, secret, "salt-b2") > 0
        salted = {**secret, "cache_salt": "mine"}
        assert cached(alice, salted, "salt-a3") == 0 and cached(alice, salted, "salt-a4") > 0


def test_an_operator_changes_a_published_engine_and_clients_end_only_their_own_requests(
        secured: PoolServer, pki: dict[str, str]) -> None:
    generate = Target.method("engine", "generate")
    abort = Target.method("engine", "abort")
    with client_as(secured, pki, "alice", options=None) as alice, client_as(secured, pki, "bob") as bob:
        for attempt in range(3):
            rid = f"alices-{attempt}"
            long = alice.stream(generate, "Once upon a time", {"max_tokens": 2000, "ignore_eos": True}, rid,
                                pool="g", timeout=120)
            next(long)
            tries: list[CallError | None] = []
            for args in ((rid,), (["x", rid],), (rid, True)):
                try:
                    bob.call(abort, *args, pool="g", timeout=10)
                    tries.append(None)
                except CallError as e:
                    tries.append(e)
            running = next(long)        # bob's aborts ended nothing
            assert alice.call(abort, rid, pool="g", timeout=10) is None
            rest = list(long)
            # Only a request still running when alice aborted it says whether bob's tries were refused:
            # on a loaded machine the 2,000 tokens may all be made before bob's calls arrive.
            if rest[-1]["outputs"][0]["finish_reason"] == "abort":
                break
        else:
            pytest.fail("alice's request finished on its own three times before it could be aborted")
        # another's live id is left alone as an unknown one is, without a word; vLLM's internal ids
        # are nobody's to abort
        assert tries[:2] == [None, None] and not running["finished"], (tries, running)
        assert tries[2] is not None and tries[2].code == DENIED and tries[2].detail.parameter == "internal", tries
        assert denied(lambda: bob.call(Target.method("engine", "pause_generation"), pool="g")).reason == "published"
        alice.call(Target.method("engine", "pause_generation"), pool="g", timeout=30)
        try:
            t0 = time.monotonic()
            with pytest.raises(CallError) as err:    # at once, not at the deadline
                list(bob.stream(generate, "Hi", {"max_tokens": 2}, "while-paused", pool="g", timeout=60))
            assert err.value.code == grpc.StatusCode.UNAVAILABLE and "paused" in err.value.details
            assert time.monotonic() - t0 < 5
        finally:
            alice.call(Target.method("engine", "resume_generation"), pool="g", timeout=30)
        items = list(bob.stream(generate, "Hi", {"max_tokens": 2}, "resumed", pool="g", timeout=60))
        assert items[-1]["finished"]


def test_a_request_nobody_can_read_ends_after_unread_request_s(secured: PoolServer, pki: dict[str, str]) -> None:
    """No client can read what an `add_request` makes (its collector has no documented member), yet its
    request ran to its last token: a stranger's fire-and-forget requests kept a shared engine full and
    busy for minutes after the stranger had gone. It now ends `unread_request_s` after it started
    (1 s in pool g), whoever holds its collector, and the collector's ref says why it went."""
    add = Target.method("engine", "add_request")
    wide = {"max_tokens": 2000, "ignore_eos": True, "n": 4, "temperature": 0.8}
    with client_as(secured, pki, "bob") as bob:
        collector = bob.call(add, "unread-by-all", "Once upon a time", wide, pool="g", timeout=30)
        started = time.monotonic()
    deadline = started + 30
    while "Aborted request(s) unread-by-all-" not in secured.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the request nobody could read was not ended"
        time.sleep(0.1)
    with client_as(secured, pki, "bob") as bob:
        with pytest.raises(CallError) as err:
            bob.call(Target.get(collector, "finished"), pool="g", timeout=10)
        assert err.value.code == grpc.StatusCode.NOT_FOUND and "(unread_request_s)" in err.value.details, err.value
        items = list(bob.stream(Target.method("engine", "generate"), "Hi", {"max_tokens": 2}, "after-unread",
                                pool="g", timeout=60))
        assert items[-1]["finished"]


def test_the_engine_core_ends_sequences_whose_grammars_grow_too_costly(secured: PoolServer,
                                                                       pki: dict[str, str]) -> None:
    """An ambiguous grammar compiles at once, but each token's mask costs the engine core more than the
    last, on the thread every request waits on: 16 such sequences stopped every request of the engine
    for 5 minutes. The worker's trial refuses this one; a grammar costly only on a path the trial did
    not take reaches the core, and pool g, which tries nothing, shows what the core does then. A
    sequence ends once its grammar costs more than 10 ms a token; and many sequences each under that
    add up (64 at ~9 ms made every step ~0.6 s longer), so the costliest end once one step's grammars
    cost more than 20 ms together. The step that showed the cost was paid by every request, so a
    repeat is refused before it reaches the engine: for a while every structured output of the client
    whose sequences were ended; its other requests, and other clients, are served (the grammar too,
    until it was ended for two clients)."""
    generate = Target.method("engine", "generate")
    grammar = 'root ::= e\ne ::= e e | e e e | "a" | "b" | "ab"'
    with client_as(secured, pki, "bob") as bob, client_as(secured, pki, "alice") as alice:
        for who, n, together in ((bob, 1, False), (alice, 16, True)):
            ask = {"temperature": 1.0, "max_tokens": 250, "min_tokens": 250, "n": n,
                   "structured_outputs": {"grammar": grammar}}
            items = list(who.stream(generate, "Hello", ask, f"costly-grammar-{n}", pool="g", timeout=120))
            assert items[-1]["finished"]
            outputs = {out["index"]: out for item in items for out in item["outputs"]}     # each completion's last
            assert sorted(outputs) == list(range(n)), outputs
            reasons = []
            for out in outputs.values():
                assert out["finish_reason"] == "abort" and len(out["token_ids"]) < 250, out
                assert "grammar cost the engine" in out["stop_reason"] or "end with it" in out["stop_reason"], \
                    out["stop_reason"]
                reasons.append(out["stop_reason"])
            if together:
                # n=16: the step's budget ends the first of them, long before any costs 10 ms a token, and
                # the client's cooldown begins: the rest end with them
                assert any("together, over the limit of 20 ms" in r for r in reasons), reasons
            else:
                assert all("over the limit of 10 ms" in r for r in reasons), reasons
            regex = {"max_tokens": 8, "structured_outputs": {"regex": "[0-9]{3}"}}
            if n == 1:
                # bob's structured outputs are refused for a while, whatever the grammar; alice's are
                # served, and she may still use bob's grammar (next round)
                refused = refusal(lambda: list(bob.stream(generate, "Hi", regex, "bobs-regex", pool="g", timeout=60)))
                assert refused.reason == "grammars ended for cost" and "1 time(s)" in \
                    refused.details and "structured_outputs" in refused.details, refused
                served = list(alice.stream(generate, "Hi", regex, "alices-regex", pool="g", timeout=60))
                assert re.fullmatch("[0-9]{3}", served[-1]["outputs"][0]["text"]), served[-1]
        # alice's n=16 were ended: her children's ends counted against her
        refused = refusal(lambda: list(alice.stream(generate, "Hi", regex, "alices-next", pool="g", timeout=60)))
        assert refused.reason == "grammars ended for cost", refused
        for who in (bob, alice):
            after = list(who.stream(generate, "Hi", {"max_tokens": 2}, "after-costly", pool="g", timeout=60))
            assert after[-1]["finished"]


def refusal(call: Callable[[], object]) -> CallError:
    with pytest.raises(CallError) as err:
        call()
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, err.value
    return err.value


def test_collective_rpc_runs_no_pickle_and_only_allowed_methods(secured: PoolServer, pki: dict[str, str],
                                                                 tmp_path: Path) -> None:
    """Even an operator (alice, on pool g's published engine) names only allowed worker methods:
    nothing is unpickled."""
    marker = tmp_path / "pwned"
    payload = pickle.dumps(_Touch(marker))
    with client_as(secured, pki, "alice") as alice, client_as(secured, pki, "bob") as bob:
        for method in (payload, bytearray(payload)):      # vLLM would unpickle bytes as the method: refused first
            with pytest.raises(CallError) as refused:
                alice.call(Target.method("engine", "collective_rpc"), method, pool="g", timeout=10)
            assert refused.value.code in (grpc.StatusCode.INVALID_ARGUMENT, DENIED) and "method" in refused.value.details
            err = denied(lambda: bob.call(Target.method("engine", "collective_rpc"), method, pool="g", timeout=10))
            assert err.reason == "published"
        err = denied(lambda: alice.call(Target.method("engine", "collective_rpc"), "check_health", pool="g", timeout=10))
        assert "collective_rpc_methods" in err.details
    time.sleep(0.5)
    assert not marker.exists()


def test_each_limit_is_refused_with_its_name(secured: PoolServer, pki: dict[str, str]) -> None:
    with client_as(secured, pki, "bob") as bob:
        with pytest.raises(CallError) as err:
            bob.call(f"{D}.divide", "x" * 70_000, 3, timeout=10)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_request_bytes" in err.value.details
        refs = [bob.call("vllm.config.ParallelConfig", session_id=f"limits-{i % 2}") for i in range(5)]
        with pytest.raises(CallError) as err:
            bob.call("vllm.config.ParallelConfig", session_id="limits-0")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_refs_per_client" in err.value.details
        bob.release(*refs)
        # One ref of five, but 24,000 bytes of the 40,000 its tensors may hold: the next such is refused,
        # and taken once the first is released.
        dp = "vllm.forward_context.DPMetadata"
        big = bob.call(dp, torch.tensor(7), torch.zeros(3000, dtype=torch.int64), session_id="bytes")
        with pytest.raises(CallError) as err:
            bob.call(dp, torch.tensor(7), torch.zeros(3000, dtype=torch.int64), session_id="bytes")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_ref_bytes_per_client" in err.value.details
        assert "(24,008 bytes)" in err.value.details and "DPMetadata" in err.value.details, err.value.details
        bob.release(big)
        bob.release(bob.call(dp, torch.tensor(7), torch.zeros(3000, dtype=torch.int64), session_id="bytes"))
        # Not only tensors: a record holding a list of 5,000 ints (40,000 bytes of slots alone) is over it too.
        with pytest.raises(CallError) as err:
            bob.call("vllm.SamplingParams", kwargs={"allowed_token_ids": list(range(5000))}, session_id="bytes")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_ref_bytes_per_client" in err.value.details
        # However deep its text lies: five lists down, it went uncounted (a stranger's refs held 1.4 GB
        # past a 1 GiB bound that way).
        with pytest.raises(CallError) as err:
            bob.call("vllm.SamplingParams", kwargs={"extra_args": {"a": [[[[["x" * 50_000]]]]]}}, session_id="bytes")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_ref_bytes_per_client" in err.value.details
        # What another ref holds counts again in an object built around it: charged to that ref only,
        # it went uncounted once that ref was released while the object kept it (1.1 GB past the bound).
        inner = bob.call("vllm.SamplingParams", kwargs={"extra_args": {"a": "x" * 30_000}}, session_id="bytes")
        with pytest.raises(CallError) as err:
            bob.call("vllm.forward_context.ForwardContext", {"p": inner}, {}, 0, session_id="bytes")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_ref_bytes_per_client" in err.value.details
        bob.release(inner)
    # Sessions: 4 per worker, of which one client may hold 3 (the last quarter is kept for others).
    with client_as(secured, pki, "alice") as alice, client_as(secured, pki, "bob") as bob:
        kept = [alice.call("vllm.config.ParallelConfig", session_id=f"cap-{i}") for i in range(3)]
        with pytest.raises(CallError) as err:
            alice.call("vllm.config.ParallelConfig", session_id="cap-3")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_sessions" in err.value.details
        assert "the most one client may hold" in err.value.details, err.value.details
        his = bob.call("vllm.config.ParallelConfig", session_id="his")
        with pytest.raises(CallError) as err:
            bob.call("vllm.config.ParallelConfig", session_id="his-too")
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "holds 4 sessions" in err.value.details
        alice.release(*kept)
        bob.release(his)


def test_a_client_makes_at_most_its_share_of_engines(secured: PoolServer, pki: dict[str, str]) -> None:
    """Each engine costs GBs: a client may make max_engines_per_client of them per worker (here 1);
    the next is refused before it starts, and releasing one makes room again."""
    args = {"model": str(ensure_tiny_model()), "dtype": "float32", "max_model_len": 256, "enforce_eager": True,
            "max_num_seqs": 4}
    with client_as(secured, pki, "alice", options=None) as alice, client_as(secured, pki, "bob") as bob:
        for memory in ({"num_gpu_blocks_override": 100_000}, {"kv_cache_memory_bytes": 2**40}, {"swap_space": 1000},
                       {"cpu_offload_gb": 100}):
            err = denied(lambda: alice.call(f"{E}.from_engine_args", {**args, **memory}, pool="g", timeout=10))
            assert "budget" in err.details and next(iter(memory)) in err.details, err
        # What sizes the buffers an engine allocates as it starts, the KV cache aside, has a ceiling.
        for size in ({"max_num_seqs": 100_000, "max_num_batched_tokens": 100_000}, {"max_num_batched_tokens": 10**7},
                     {"enable_lora": True, "max_loras": 1000}, {"enable_lora": True, "max_lora_rank": 512},
                     {"max_logprobs": -1}, {"gpu_memory_utilization": 1.0},
                     {"enable_chunked_prefill": False, "max_model_len": 100_000}):
            t0 = time.monotonic()
            with pytest.raises(CallError) as refused:
                alice.call(f"{E}.from_engine_args", {**args, **size}, pool="g", timeout=30)
            assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
            assert refused.value.reason == "over the client limit" and "engine_args_allowed" in refused.value.details
            # named as the call's parameter's field
            assert refused.value.detail is not None and refused.value.detail.parameter.removeprefix(
                "engine_args.") in size and refused.value.detail.parameter.startswith("engine_args."), refused.value
            assert time.monotonic() - t0 < 5     # refused before it starts
        with pytest.raises(CallError) as refused:     # past it the engine core fails to start
            alice.call(f"{E}.from_engine_args", {**args, "seed": 2**32}, pool="g", timeout=10)
        assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "seed" in refused.value.details
        for block in (1, 8):      # the configuration takes them; the CPU attention kernels abort at the first step
            with pytest.raises(CallError) as refused:
                alice.call(f"{E}.from_engine_args", {**args, "block_size": block}, pool="g", timeout=10)
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT, refused.value
            assert "field block_size: expected a multiple of 16" in refused.value.details, refused.value
        # A build its caller gives up on still starts an engine core: it counts until it ends.
        with pytest.raises(CallError) as cut:
            alice.call(f"{E}.from_engine_args", args, pool="g", timeout=1)
        assert cut.value.code == grpc.StatusCode.DEADLINE_EXCEEDED, cut.value
        with pytest.raises(CallError) as refused:
            alice.call(f"{E}.from_engine_args", args, pool="g", timeout=10)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, refused.value
        assert "max_engines_per_client" in refused.value.details
        until = time.monotonic() + 120
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            while True:         # the abandoned build ends (its engine, unowned, ends with it): room again
                making = pool.submit(alice.call, f"{E}.from_engine_args", args, pool="g", timeout=120)
                time.sleep(2)   # a refusal takes milliseconds: one still running was admitted
                others = 0
                while not making.done():
                    # An engine counts while it is built, warmed up and delivered: one warming up had
                    # counted nowhere, and creates sent then were made.
                    with pytest.raises(CallError) as other:
                        alice.call(f"{E}.from_engine_args", args, pool="g", timeout=10)
                    assert other.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED, other.value
                    assert "max_engines_per_client" in other.value.details, other.value
                    others += 1
                    time.sleep(0.25)
                try:
                    engine = making.result()
                    break
                except CallError as err_:
                    assert err_.code == grpc.StatusCode.RESOURCE_EXHAUSTED and time.monotonic() < until, err_
                    time.sleep(1)
        assert others > 0
        t0 = time.monotonic()
        with pytest.raises(CallError) as err:
            alice.call(f"{E}.from_engine_args", args, pool="g", timeout=120)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "max_engines_per_client" in err.value.details
        assert time.monotonic() - t0 < 5
        denied(lambda: bob.call(Target.method(engine, "check_health"), pool="g"))   # not his either
        assert alice.call(Target.method(engine, "check_health"), pool="g") is None
        assert alice.release(engine) == 1
        with pytest.raises(CallError) as err:     # gone with its last ref; alice may make another now
            alice.call(Target.method(engine, "check_health"), pool="g")
        assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_a_ref_to_a_published_object_never_ends_it_when_released() -> None:
    """Engines end with their last ref, but a result can be the published engine itself (as ITERATE
    called with Call was): a client that gets a ref to it and releases the ref leaves it running. A
    worker built as a real one is, with the class's finalizer watched: it runs for a client's own
    object only."""
    import asyncio

    from bridge_server.worker.server import WorkerConfig, build_worker, default_catalog

    class Engine:
        pass

    ended: list[object] = []
    catalog = default_catalog()
    catalog.finalizers[Engine] = ended.append

    async def run() -> None:
        published, own = Engine(), Engine()
        worker = build_worker(WorkerConfig(listen="127.0.0.1:0"), catalog=catalog, objects={"engine": published})
        refs = worker.invoker.refs
        for obj in (published, published, own):
            entry = refs.put(obj, "s", owner="stranger")
            assert refs.release([entry.id], "stranger") == 1
        assert ended == [own]
        await worker.server.stop(None)

    asyncio.run(run())


def test_without_an_identity_engines_are_shared_out_by_connection_and_host() -> None:
    """Without authentication the clients' engine limit is one for them all: a stranger that made
    max_engines_per_client engines and left kept everyone else from making one. Each connection
    (within its host) takes its share; an engine counts once, against whoever made its first ref,
    and one being made counts too."""
    from bridge_server.worker.refs import RefRegistry, payer_of

    class Engine:
        pass

    refs = RefRegistry("w")
    stranger, neighbour, elsewhere = "ipv4:127.0.0.1:4001", "ipv4:127.0.0.2:4002", "ipv4:10.0.0.9:4003"
    engine = Engine()
    refs.put(engine, "s", connection=stranger)
    refs.put(engine, "t", connection=neighbour)       # a second ref to the same engine: still its maker's
    refs.put(Engine(), "s", connection=stranger)
    refs.put(object(), "s", connection=stranger)      # not an engine

    def refusal(connection: str, making: dict[tuple[str, str | None], int] | None = None) -> str:
        held = refs.tally(lambda obj: isinstance(obj, Engine), making or {})
        return held.refusal(*payer_of("", connection), 1, 4, "engines")

    # of 4, a host alone holds 3 (3/4, rounded up) and a connection 3/4 of that: the stranger has its 2
    assert "this connection holds 2 engines, its share" in refusal(stranger)
    assert refusal(neighbour) == "" and refusal(elsewhere) == ""     # loopback is one host: 127.0.0.2 too
    being_made = {payer_of("", neighbour): 1}
    assert refusal(elsewhere, being_made) == ""
    # connections cost nothing: a third on the same host is held to the host's share (3 of 4)
    assert "this connection's host holds 3 engines, its share" in refusal("ipv4:127.0.0.1:4009", being_made)
    assert "together" in refusal(elsewhere, {**being_made, payer_of("", elsewhere): 1})
    # an identity has its limit to itself
    assert refs.tally(lambda obj: isinstance(obj, Engine), {}).refusal(*payer_of("alice", ""), 1, 4, "engines") == ""
    # refs alike: a thousand connections of one host, a ref each, hold three quarters of 40
    many = RefRegistry("w", max_refs_per_client=40)
    held = 0
    with pytest.raises(BridgeError) as err:
        for port in range(1000, 2000):
            many.put(object(), "s", connection=f"ipv4:10.1.2.3:{port}")
            held += 1
    assert held == 30 and err.value.reason == "max_refs_per_client", (held, err.value)
    assert many.put(object(), "s", connection="ipv4:10.9.9.9:1") is not None      # another host: room left


def test_engine_constructors_refuse_what_calls_back_or_connects_and_take_the_defaults(client: BridgeClient) -> None:
    """`new` (AsyncLLM's own constructor) takes no factories, registries or addresses from a client,
    and vLLM's own defaults for them are not mistaken for given ones."""
    config = client.call("vllm.config.VllmConfig", timeout=10)
    err = denied(lambda: client.call(E, kwargs={"vllm_config": config,
                                                "client_addresses": {"input_address": "tcp://10.0.0.1:1"}}, timeout=10))
    assert err.detail is not None and err.detail.parameter == "client_addresses", err
    with pytest.raises(CallError) as err:       # past the guard: vLLM itself refuses a config with no model
        client.call(E, kwargs={"vllm_config": config}, timeout=60)
    assert err.value.code != DENIED, err.value
    client.release(config)


def test_iterate_on_the_engine_hands_out_nothing_and_says_why(client: BridgeClient) -> None:
    """ITERATE called with Call gave back a ref to its receiver, the published engine included; then
    Call said to use Stream, and Stream to use Call."""
    target = Target(pb.Target(kind=pb.Target.ITERATE, object="engine"))
    for attempt in (lambda: client.call(target, timeout=10), lambda: list(client.stream(target, timeout=10))):
        with pytest.raises(CallError) as err:
            attempt()
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value
        assert "ITERATE streams the items" in err.value.details and "AsyncLLM is none of them" in err.value.details


def test_an_operator_lifts_a_ceiling_by_allowing_the_argument() -> None:
    """The rule every engine-args record goes through, under the policy a worker is given: naming an
    argument in engine_args_allowed lifts its ceiling, and only its own."""
    from adapters.engine_making import ENGINE_ARG_CEILINGS, engine_args_rule
    from adapters.spec import Policy

    big = {"max_num_seqs": ENGINE_ARG_CEILINGS["max_num_seqs"] * 4, "max_loras": 1000}
    lifted = Policy(engine_args_allowed=frozenset({"max_num_seqs"}))
    with pytest.raises(BridgeError) as err:
        engine_args_rule(big, lifted)
    assert err.value.parameter == "max_loras"
    engine_args_rule({"max_num_seqs": big["max_num_seqs"]}, lifted)
    with pytest.raises(BridgeError) as err:
        engine_args_rule({"max_num_seqs": big["max_num_seqs"]}, Policy())
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and err.value.parameter == "max_num_seqs"


def test_mutual_tls_names_its_client(tmp_path: Path, pki: dict[str, str]) -> None:
    config = f"""
tls_cert = "{pki['server']}"
tls_key = "{pki['server_key']}"
tls_client_ca = "{pki['ca']}"
[[pools]]
name = "p"
workers = 1
"""
    s = start_pool_server(tmp_path, config, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"])
    try:
        with BridgeClient(s.address, tls_ca=pki["ca"], token="") as anonymous, pytest.raises(CallError) as err:
            anonymous.call(f"{D}.divide", 6, 3, timeout=5)    # no client certificate: no connection
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        with BridgeClient(s.address, tls_ca=pki["ca"], tls_cert=pki["client"], tls_key=pki["client_key"],
                          token="") as alice:
            ref = alice.call("vllm.config.ParallelConfig")
            assert alice.call(Target.get(ref, "world_size")) == 1
    finally:
        s.stop()


def _start(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "bridge_server.cli", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_listening_beyond_this_machine_needs_tls_and_tokens_or_insecure(tmp_path: Path) -> None:
    (tmp_path / "pool.toml").write_text('[[pools]]\nname = "p"\nworkers = 1\n')
    for argv in (["serve", "--config", str(tmp_path / "pool.toml"), "--listen", f"0.0.0.0:{free_port()}"],
                 ["worker", "--listen", f"0.0.0.0:{free_port()}"]):
        done = _start(*argv)
        assert done.returncode == 2 and "--insecure" in done.stderr, done.stderr[-2000:]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bridge_server.cli", "worker", "--listen", f"0.0.0.0:{port}",
                             "--insecure"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        from tests.conftest import wait_healthy
        wait_healthy(f"127.0.0.1:{port}", proc, None)
    finally:
        proc.terminate()
        proc.wait(30)


def test_the_cli_speaks_tls_with_a_token(secured: PoolServer, pki: dict[str, str], tmp_path: Path) -> None:
    (tmp_path / "mine").write_text("alice:alice-token-0123456789abcdef\n")
    done = _start("call", f"{D}.divide", "6", "3", "--address", secured.address, "--token-file",
                  str(tmp_path / "mine"), "--tls-ca", pki["ca"])
    assert done.returncode == 0 and done.stdout.strip() == "2", done.stderr[-2000:]
    env = {**os.environ, "VLLM_BRIDGE_TOKEN": "bob-token-0123456789abcdef0"}
    done = subprocess.run([sys.executable, "-m", "bridge_server.cli", "status", "--address", secured.address,
                           "--tls-ca", pki["ca"]], cwd=ROOT, capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0 and '"pools"' in done.stdout, done.stderr[-2000:]
    done = _start("status", "--address", secured.address, "--tls-ca", pki["ca"])
    assert done.returncode == 1 and "UNAUTHENTICATED" in done.stderr
