"""The catalog as the `Describe` RPC returns it: names, parameters, types, streaming.

Clients (the Elixir binding generator, `vllm-bridge describe`) learn the surface from this alone, so
every parameter carries both what the installed vLLM says (kind, default, annotation) and what the
binding documents say (the documented type).
"""

from __future__ import annotations

import inspect
from importlib import metadata

from bridge_server.catalog import Catalog, Entry
from vllm_bridge.v1 import bridge_pb2 as pb

_PARAM_KIND = {
    inspect.Parameter.POSITIONAL_ONLY: pb.Parameter.POSITIONAL_ONLY,
    inspect.Parameter.POSITIONAL_OR_KEYWORD: pb.Parameter.POSITIONAL_OR_KEYWORD,
    inspect.Parameter.VAR_POSITIONAL: pb.Parameter.VAR_POSITIONAL,
    inspect.Parameter.KEYWORD_ONLY: pb.Parameter.KEYWORD_ONLY,
    inspect.Parameter.VAR_KEYWORD: pb.Parameter.VAR_KEYWORD,
}


def _annotation(a: object) -> str:
    if a is inspect.Parameter.empty:
        return ""
    return a if isinstance(a, str) else inspect.formatannotation(a)


def _parameters(entry: Entry) -> list[pb.Parameter]:
    documented = {p.name.lower(): p for p in (entry.doc.params if entry.doc else ())}
    out = []
    if entry.signature is not None:
        for p in entry.signature.parameters.values():
            doc = documented.get(p.name.lower())
            has_default = p.default is not inspect.Parameter.empty
            out.append(pb.Parameter(name=p.name, kind=_PARAM_KIND[p.kind], has_default=has_default,
                                    default_repr=repr(p.default) if has_default else "",
                                    doc_type=doc.type if doc else "", annotation=_annotation(p.annotation)))
    elif entry.doc is not None:   # no introspectable signature: the documents are all we know
        for d in entry.doc.params:
            out.append(pb.Parameter(name=d.name, kind=pb.Parameter.KEYWORD_ONLY if d.keyword_only
                                    else pb.Parameter.POSITIONAL_OR_KEYWORD, has_default=d.has_default,
                                    default_repr=d.default or "", doc_type=d.type))
    return out


def describe(catalog: Catalog) -> pb.Catalog:
    entries = [
        pb.CatalogEntry(
            name=e.name, kind=pb.CatalogEntry.Kind.Name(e.kind.value), module=e.module, class_name=e.class_name, parameters=_parameters(e),
            return_type=e.doc.returns if e.doc else "ref", streams=e.streams, is_async=e.is_async,
            summary=e.doc.summary if e.doc else (inspect.getdoc(e.owner) or "").split("\n")[0],
            default_timeout_profile=e.profile, exclusive=e.exclusive, documented_in=e.document)
        for e in sorted(catalog.entries.values(), key=lambda e: e.name)
    ]
    return pb.Catalog(entries=entries, vllm_version=_version("vllm"), bridge_version=_version("vllm-bridge"))


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "unknown"
