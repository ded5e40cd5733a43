"""The Elixir client (`mix_client_example/`) binds every documented name, as the documents say.

CI has no Elixir, so the committed `.ex` files are read as text: every `def` head gives a function
name and its arities, every body the target it calls. Checked against the documents (names,
arities) and the catalog the server builds (target kinds, streaming), plus: regenerating changes
nothing, the committed protobuf modules match `bridge.proto`, and the runtime options map to the
metadata keys of `bridge_server/wire/options.py`. Compiling and running the project is done by hand.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from adapters.surface import DocSurface, load_surfaces
from bridge_server.client.client import DEFAULT_STREAM_ENCODING
from bridge_server.tools import elixir_gen
from bridge_server.wire import options, protocol
from vllm_bridge.v1 import bridge_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
MIX = ROOT / "mix_client_example"
GENERATED = MIX / "lib" / "vllm"
CE = pb.CatalogEntry
_DEF = re.compile(r"^  def (\w+[?!]?)\((.*?)\)(?: when [^,]+)?, do: (.*)$", re.M)
_MODULE = re.compile(r"^defmodule ([\w.]+) do$", re.M)
# How each catalog kind is called from Elixir: the body of the binding names the target so.
_CALLS = {
    CE.FUNCTION: '{{:function, "{name}"}}',
    CE.MODULE_ATTR: '{{:module_attr, "{name}"}}',
    CE.CONSTRUCTOR: '{{:constructor, "{name}"}}',
    CE.METHOD: '{{:method, ref, "{attr}"}}',
    CE.ATTRIBUTE: '{{:get_attr, ref, "{attr}"}}',
    CE.CLASSMETHOD: 'B.classmethod(ref, "{attr}", "{name}")',
}


@dataclass
class ElixirModule:
    name: str
    arities: dict[str, set[int]] = field(default_factory=lambda: defaultdict(set))
    bodies: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))


def split_args(text: str) -> list[str]:
    """Top-level comma split (arguments may hold lists, tuples or maps)."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return out + ([cur.strip()] if cur.strip() else [])


def parse_elixir(path: Path) -> ElixirModule:
    text = path.read_text(encoding="utf-8")
    modules = _MODULE.findall(text)
    assert len(modules) == 1, f"{path}: expected one module, found {modules}"
    mod = ElixirModule(modules[0])
    for name, params, body in _DEF.findall(text):
        args = split_args(params)
        defaults = sum("\\\\" in a for a in args)
        mod.arities[name].update(range(len(args) - defaults, len(args) + 1))
        mod.bodies[name].append(body)
    return mod


@pytest.fixture(scope="module")
def catalog() -> pb.Catalog:
    return elixir_gen.local_catalog()


@pytest.fixture(scope="module")
def surfaces() -> dict[str, DocSurface]:
    return load_surfaces()


@pytest.fixture(scope="module")
def modules() -> dict[str, ElixirModule]:
    parsed = [parse_elixir(p) for p in sorted(GENERATED.rglob("*.ex"))]
    return {m.name: m for m in parsed}


def test_the_documented_modules_are_generated(surfaces: dict[str, DocSurface],
                                              modules: dict[str, ElixirModule]) -> None:
    assert set(modules) == {s.elixir_module for s in surfaces.values()} == {
        "Vllm.ForwardContext.Module", "Vllm.Distributed", "Vllm.ForwardContext.DPMetadata", "Vllm.AsyncLLMEngine"}


def test_every_documented_function_has_its_documented_arities(surfaces: dict[str, DocSurface],
                                                             modules: dict[str, ElixirModule]) -> None:
    problems, count = [], 0
    for surface in surfaces.values():
        mod = modules[surface.elixir_module]
        for doc in surface.entries:
            count += 1
            missing = set(doc.arities) - mod.arities.get(doc.name, set())
            if missing:
                problems.append(f"{surface.elixir_module}.{doc.name}: documented arities {sorted(missing)} missing "
                                f"(generated {sorted(mod.arities.get(doc.name, ()))})")
        extra = set(mod.arities) - {d.name for d in surface.entries}
        if extra:
            problems.append(f"{surface.elixir_module}: functions no document names: {sorted(extra)}")
    assert not problems, "\n".join(problems)
    assert count == sum(len(s.entries) for s in surfaces.values()) == 122


def test_every_catalog_entry_of_the_documents_is_called_with_its_kind(catalog: pb.Catalog,
                                                                      surfaces: dict[str, DocSurface],
                                                                      modules: dict[str, ElixirModule]) -> None:
    by_document = {s.document: s for s in surfaces.values()}
    documented = [e for e in catalog.entries if e.documented_in]
    assert len(documented) == 122
    problems = []
    for e in documented:
        surface = by_document[e.documented_in]
        mod = modules[surface.elixir_module]
        fn = "new" if e.kind == CE.CONSTRUCTOR else e.name.rsplit(".", 1)[1]
        call = _CALLS[e.kind].format(name=e.name, attr=fn)
        mode = ":stream" if e.streams else ":call"
        bodies = mod.bodies.get(fn, [])
        if not bodies or not all(call in b and f"B.invoke({mode}, " in b for b in bodies):
            problems.append(f"{e.name} ({CE.Kind.Name(e.kind)}): expected every {surface.elixir_module}.{fn} "
                            f"to call B.invoke({mode}, {call}, ...); got {bodies[:1]}")
    assert not problems, "\n".join(problems)


def test_streaming_entries_return_streams(modules: dict[str, ElixirModule]) -> None:
    engine = modules["Vllm.AsyncLLMEngine"]
    streaming = {n for n, bodies in engine.bodies.items() if all("B.invoke(:stream," in b for b in bodies)}
    assert streaming == {"generate", "encode"}


def test_regenerating_from_the_catalog_changes_nothing(catalog: pb.Catalog) -> None:
    expected = elixir_gen.generate(catalog)
    committed = {p.relative_to(GENERATED): p.read_text(encoding="utf-8") for p in GENERATED.rglob("*.ex")}
    assert set(committed) == set(expected), "generated file set differs: run `vllm-bridge gen-elixir`"
    stale = [str(p) for p, text in expected.items() if committed[p] != text]
    assert not stale, f"stale generated modules {stale}: run `vllm-bridge gen-elixir` and commit the result"


def test_the_generator_refuses_a_catalog_that_does_not_serve_the_documents(catalog: pb.Catalog,
                                                                          surfaces: dict[str, DocSurface]) -> None:
    entries = {e.name: e for e in catalog.entries}
    del entries["vllm.distributed.divide"]
    with pytest.raises(ValueError, match="vllm.distributed.divide is documented but the catalog does not serve it"):
        elixir_gen.bind(surfaces["distributed"], entries)
    entries = {e.name: e for e in catalog.entries}
    entries["vllm.distributed.extra"] = CE(name="vllm.distributed.extra", kind=CE.FUNCTION,
                                           documented_in=surfaces["distributed"].document)
    with pytest.raises(ValueError, match="no document binds"):
        elixir_gen.bind(surfaces["distributed"], entries)


def test_generator_naming() -> None:
    assert elixir_gen.module_path("Vllm.ForwardContext.DPMetadata") == Path("forward_context/dp_metadata.ex")
    assert elixir_gen.module_path("Vllm.AsyncLLMEngine") == Path("async_llm_engine.ex")
    assert elixir_gen.elixir_type("Vllm.SamplingParamsClass.t()") == "term()"
    assert elixir_gen.elixir_type("MapSet.t(integer())") == "MapSet.t(integer())"
    assert elixir_gen.elixir_type("{boolean(), term(), integer()}") == "{boolean(), term(), integer()}"
    taken: set[str] = set()
    assert [elixir_gen.var(n, taken) for n in ("A_scale", "end", "opts", "a_scale")] == ["a_scale", "end_", "opts_",
                                                                                         "a_scale_"]


def test_committed_protobuf_modules_match_the_proto() -> None:
    """The `.pb.ex` files are committed (users need no protoc); what the client speaks must follow
    `bridge.proto`: every message reachable from the service's RPCs (and ErrorDetail), field by field,
    and every RPC, and the StreamEncoding enum (named in metadata, by no field). Messages nothing on the
    wire refers to (the router's internal views) are not needed."""
    text = (MIX / "lib" / "vllm_bridge" / "proto" / "bridge.pb.ex").read_text(encoding="utf-8")
    blocks = dict(re.findall(r"defmodule ([\w.]+) do\n(.*?)\nend\n", text, re.S))
    service = pb.DESCRIPTOR.services_by_name["Bridge"]
    todo = [pb.ErrorDetail.DESCRIPTOR] + [t for m in service.methods for t in (m.input_type, m.output_type)]
    seen: set[str] = set()
    problems = []
    while todo:
        msg = todo.pop()
        if msg.full_name in seen:
            continue
        seen.add(msg.full_name)
        name = "VllmBridge.V1." + msg.full_name.removeprefix("vllm_bridge.v1.")
        body = blocks.get(name)
        if body is None:
            problems.append(f"missing module {name}")
            continue
        for f in msg.fields:
            if not re.search(rf"^  field :{f.name}, {f.number}\b", body, re.M):
                problems.append(f"{name}: field {f.name} = {f.number} missing")
            if f.message_type is not None:
                todo.append(f.message_type)
            if f.enum_type is not None:
                enum = "VllmBridge.V1." + f.enum_type.full_name.removeprefix("vllm_bridge.v1.")
                values = [v.name for v in f.enum_type.values]
                if not all(re.search(rf"^  field :{v}, ", blocks.get(enum, ""), re.M) for v in values):
                    problems.append(f"enum {enum}: expected values {values}")
    encoding = pb.DESCRIPTOR.enum_types_by_name["StreamEncoding"]
    if not all(re.search(rf"^  field :{v.name}, {v.number}$", blocks.get("VllmBridge.V1.StreamEncoding", ""), re.M)
               for v in encoding.values):
        problems.append(f"enum VllmBridge.V1.StreamEncoding: expected values {[v.name for v in encoding.values]}")
    assert not problems, "regenerate lib/vllm_bridge/proto/bridge.pb.ex (README, Regenerating):\n" + "\n".join(problems)
    assert len(seen) >= 20
    for method in service.methods:
        request = f"VllmBridge.V1.{method.input_type.name}"
        request = f"stream({request})" if method.client_streaming else request
        assert f"rpc :{method.name}, {request}" in blocks["VllmBridge.V1.Bridge.Service"]


def test_runtime_options_are_sent_as_the_protocol_metadata_keys() -> None:
    runtime = (MIX / "lib" / "vllm_bridge" / "runtime.ex").read_text(encoding="utf-8")
    table = dict(re.findall(r"^    (\w+): \"(x-bridge-[\w-]+)\"", runtime, re.M))
    assert table == {"session_id": options.MD_SESSION, "timeout_profile": options.MD_TIMEOUT_PROFILE,
                     "stream_timeout": options.MD_STREAM_TIMEOUT_MS, "pool_name": options.MD_POOL,
                     "affinity": options.MD_AFFINITY, "stream_interval": options.MD_STREAM_INTERVAL_MS,
                     "rank": options.MD_RANK, "stream_encoding": options.MD_STREAM_ENCODING,
                     "stream_tee": options.MD_STREAM_TEE}
    assert f'"{options.MD_REFS}"' in runtime
    # validated on the client against the protocol's own lists
    profiles = re.search(r"^  @profiles ~w\((.*)\)$", runtime, re.M)
    affinities = re.search(r"^  @affinities ~w\((.*)\)$", runtime, re.M)
    assert profiles and profiles.group(1).split() == list(options.PROFILES)
    assert affinities and affinities.group(1).split() == list(options.AFFINITY_MODES)
    # the stream encodings it asks for: those it can read, by the protocol's names; by default the
    # Python client's list (patch-v2, then patch-v1)
    encodings = re.search(r"^  @stream_encodings ~w\((.*)\) \+\+ \[@stream_encoding_default\]$", runtime, re.M)
    assert encodings and sorted(encodings.group(1).split()) == sorted(options.STREAM_ENCODINGS)
    assert f'@stream_encoding_default "{DEFAULT_STREAM_ENCODING}"' in runtime
    assert "stream_encoding: @stream_encoding_default," in runtime
    # not metadata: the deadline, which server, the transport of a stream, how tensors come back
    assert "@local [:timeout, :server, :multiplex, :tensors]" in runtime


def test_the_elixir_client_pings_no_more_often_than_the_servers_accept() -> None:
    """A client that pings an idle connection more often than the server's policy allows is sent
    GOAWAY (too_many_pings) and loses every call on it: the Elixir client's smallest and default
    keepalive must both respect the protocol's MIN_PING_INTERVAL_S."""
    config = (MIX / "lib" / "vllm_bridge" / "config.ex").read_text(encoding="utf-8")
    smallest = re.search(r"^  @min_keepalive ([\d_]+)$", config, re.M)
    defaults = re.findall(r"keepalive: ([\d_]+),", config) + re.findall(r":keepalive, ([\d_]+)\)", config)
    assert smallest and int(smallest.group(1).replace("_", "")) >= protocol.MIN_PING_INTERVAL_S * 1000
    assert defaults and all(int(d.replace("_", "")) >= protocol.MIN_PING_INTERVAL_S * 1000 for d in defaults), defaults
