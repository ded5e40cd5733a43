"""The catalog: every name a client can call, built once per worker.

The binding documents decide which names exist (`adapters/surface.py`); the
installed vLLM decides the signatures (by introspection). Keeping the two apart means a vLLM upgrade
changes signatures without anyone editing name lists, and nothing outside the documents can be
reached by name.

`describe` gives the catalog as the `Describe` RPC returns it. Clients (the Elixir binding generator,
`vllm-bridge describe`) learn the surface from that alone, so every parameter carries both what the
installed vLLM says (kind, default, annotation) and what the binding documents say (the documented
type).
"""

from __future__ import annotations

import difflib
import enum
import functools
import importlib
import inspect
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from adapters.spec import AdapterSpec, Exposure, Guard, Lifecycle, RecordRule
from adapters.surface import DocEntry, DocSurface, load_surfaces
from bridge_server.wire.codec import without_addresses
from bridge_server.wire.errors import BridgeError
from vllm_bridge.v1 import bridge_pb2 as pb


class Kind(enum.Enum):
    FUNCTION = 1
    MODULE_ATTR = 2
    CONSTRUCTOR = 3
    CLASSMETHOD = 4
    METHOD = 5
    ATTRIBUTE = 6


@dataclass
class Entry:
    name: str                       # public, fully qualified
    kind: Kind
    module: str
    class_name: str
    attr: str                       # the Python attribute name
    owner: Any                      # the module or class that holds `attr`
    signature: inspect.Signature | None
    doc: DocEntry | None
    document: str = ""
    streams: bool = False
    is_async: bool = False
    exclusive: bool = False
    inline: bool = False
    result_ref: bool = False
    profile: str = "default"
    guard: Guard | None = None
    override: Callable[..., Any] | None = None    # an adapter's replacement for the Python callable
    collective: bool = False        # communicates with every rank: only as a Collective in a distributed pool
    frees: bool = False             # ends what other calls made (AdapterSpec.frees)
    per_client: bool = True         # any client may call it on a published instance (AdapterSpec.per_client)

    def resolve(self) -> Any:
        """The live object: read at call time, so module attributes reflect the current state."""
        return getattr(self.owner, self.attr)


def _signature(obj: Any, *, drop_self: bool = False) -> inspect.Signature | None:
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    if drop_self:
        params = list(sig.parameters.values())[1:]
        sig = sig.replace(parameters=params)
    return sig


def _streams(fn: Any) -> tuple[bool, bool]:
    """(yields items, is a coroutine/async generator function). Not unwrapped: a @contextmanager
    wraps a generator function but returns a context manager, which is called, not streamed."""
    if inspect.isasyncgenfunction(fn):
        return True, True
    return inspect.isgeneratorfunction(fn), inspect.iscoroutinefunction(fn)


@dataclass
class Catalog:
    entries: dict[str, Entry] = field(default_factory=dict)
    methods: dict[type, dict[str, Entry]] = field(default_factory=dict)   # class -> name -> entry
    types: dict[str, type] = field(default_factory=dict)    # qualified name -> class clients may build
    type_aliases: dict[str, type] = field(default_factory=dict)   # constructor name (vllm.PoolingParams) -> class
    records: dict[type, tuple[str, ...]] = field(default_factory=dict)   # plain classes sent by value
    record_constants: dict[type, frozenset[str]] = field(default_factory=dict)   # per stream, see codec
    record_growing: dict[type, frozenset[str]] = field(default_factory=dict)     # per stream, see patch
    finalizers: dict[type, Callable[[Any], None]] = field(default_factory=dict)
    expiring: set[type] = field(default_factory=set)     # refs to these go after a while (Finalizer.expires)
    lifecycles: dict[type, Lifecycle] = field(default_factory=dict)
    rules: dict[type, RecordRule] = field(default_factory=dict)          # what a client may set when building one
    exposures: dict[type, Exposure] = field(default_factory=dict)       # members of undocumented result types
    documents: dict[str, DocSurface] = field(default_factory=dict)

    @functools.cached_property
    def short_types(self) -> dict[str, type]:
        """Constructible classes by bare name, longest first, to match against annotations."""
        return {c.__name__: c for c in sorted(self.types.values(), key=lambda c: -len(c.__name__))}

    def lookup(self, name: str) -> Entry:
        entry = self.entries.get(name)
        if entry is None:
            close = difflib.get_close_matches(name, list(self.entries), n=5, cutoff=0.6)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise BridgeError.not_found(f"{name!r} is not in the catalog{hint}", target=name, suggestions=close)
        return entry

    def member(self, obj: object, name: str) -> Entry | None:
        """The documented entry for `name` on obj's class (or a base class), if any."""
        for cls in type(obj).__mro__:
            found = self.methods.get(cls, {}).get(name)
            if found is not None:
                return found
        return None

    def resolve_type(self, qualname: str) -> type | None:
        """Types a Record or Enum from a client may be rebuilt into: the catalog's own classes."""
        found = self.types.get(qualname) or self.type_aliases.get(qualname)
        if found is not None:
            return found
        # Enums used in vLLM signatures (CUDAGraphMode, ...) are allowed by their home module.
        module, _, attr = qualname.rpartition(".")
        if module.startswith("vllm.") and module in sys.modules:
            obj = getattr(sys.modules[module], attr, None)
            if isinstance(obj, type) and issubclass(obj, enum.Enum):
                return obj
        return None

    @functools.cached_property
    def names(self) -> frozenset[str]:
        return frozenset(self.entries)

    @functools.cached_property
    def code_objects(self) -> frozenset[int]:
        """The ids of the functions and classes the catalog itself names: the only code a ref may
        point to (read at first use: every catalog entry resolves by then)."""
        ids = {id(c) for c in self.types.values()}
        for e in self.entries.values():
            if e.kind in (Kind.FUNCTION, Kind.CLASSMETHOD, Kind.MODULE_ATTR):
                ids.add(id(e.resolve()))
            elif e.kind is Kind.CONSTRUCTOR:
                ids.add(id(e.owner))
        return frozenset(ids)

    def exposure(self, obj: object) -> Exposure | None:
        """What an adapter lets clients reach on obj's (undocumented) type, if anything."""
        return next((x for cls in type(obj).__mro__ if (x := self.exposures.get(cls)) is not None), None)

    def rule(self, cls: type) -> RecordRule | None:
        return next((r for c in cls.__mro__ if (r := self.rules.get(c)) is not None), None)

    def lifecycle(self, obj: object) -> Lifecycle | None:
        """How instances like obj can die under the worker, if they can."""
        return next((lc for cls in type(obj).__mro__ if (lc := self.lifecycles.get(cls)) is not None), None)

    def finalize(self, obj: object) -> None:
        """Called when the last ref to obj is released: engines must not outlive their refs."""
        for cls in type(obj).__mro__:
            fn = self.finalizers.get(cls)
            if fn is not None:
                fn(obj)
                return

    def expires(self, obj: object) -> bool:
        """Whether refs to obj go a while after it was handed out, whoever holds them."""
        return bool(self.expiring) and any(cls in self.expiring for cls in type(obj).__mro__)

    def add(self, entry: Entry) -> None:
        self.entries[entry.name] = entry
        if entry.kind in (Kind.METHOD, Kind.ATTRIBUTE, Kind.CLASSMETHOD) and isinstance(entry.owner, type):
            self.methods.setdefault(entry.owner, {})[entry.attr] = entry


def _guard(spec: AdapterSpec, name: str) -> Guard | None:
    return spec.guards.get(name) or spec.guards.get("*")


def _module_entry(spec: AdapterSpec, module: Any, doc: DocEntry, surface: DocSurface) -> Entry:
    attr = spec.aliases.get(doc.name, doc.name)
    if not hasattr(module, attr):
        raise RuntimeError(f"{spec.module} has no {attr!r}, which {surface.document} documents")
    obj = getattr(module, attr)
    callable_ = callable(obj) and not doc.attribute
    streams, is_async = _streams(obj) if callable_ else (False, False)
    return Entry(
        name=f"{spec.prefix}.{doc.name}", kind=Kind.FUNCTION if callable_ else Kind.MODULE_ATTR,
        module=spec.module, class_name="", attr=attr, owner=module,
        signature=_signature(obj) if callable_ else None, doc=doc, document=surface.document,
        streams=streams, is_async=is_async, exclusive=spec.exclusive and doc.name not in spec.shared,
        inline=doc.name in spec.inline, result_ref=doc.name in spec.result_refs,
        profile=spec.profiles.get(doc.name, "streaming" if streams else "default"), guard=_guard(spec, doc.name),
        override=spec.overrides.get(doc.name), collective=doc.name in spec.collectives,
        frees=doc.name in spec.frees)


def _class_entry(spec: AdapterSpec, cls: type, doc: DocEntry, surface: DocSurface) -> Entry:
    common = dict(module=spec.module, class_name=cls.__name__, owner=cls, doc=doc, document=surface.document,
                  exclusive=spec.exclusive and doc.name not in spec.shared, guard=_guard(spec, doc.name),
                  result_ref=doc.name in spec.result_refs)
    if doc.name == "new":
        ctor = spec.overrides.get("new", cls)
        return Entry(name=spec.prefix, kind=Kind.CONSTRUCTOR, attr="__init__", result_ref=True,
                     signature=_signature(ctor), profile=spec.profiles.get("new", "default"), override=ctor,
                     **{k: v for k, v in common.items() if k != "result_ref"})  # type: ignore[arg-type]
    attr = spec.aliases.get(doc.name, doc.name)
    static = inspect.getattr_static(cls, attr, None)
    if isinstance(static, (staticmethod, classmethod)):
        kind, fn = Kind.CLASSMETHOD, getattr(cls, attr)
        sig = _signature(fn)
    elif callable(static) and not doc.attribute:
        kind, fn = Kind.METHOD, static
        sig = _signature(static, drop_self=True)
    else:   # a property, a dataclass field, or an instance attribute set in __init__
        kind, fn, sig = Kind.ATTRIBUTE, None, None
    streams, is_async = _streams(fn) if fn is not None else (False, False)
    return Entry(name=f"{spec.prefix}.{doc.name}", kind=kind, attr=attr, signature=sig, streams=streams,
                 is_async=is_async, profile=spec.profiles.get(doc.name, "streaming" if streams else "default"),
                 override=spec.overrides.get(doc.name), collective=doc.name in spec.collectives,
                 frees=doc.name in spec.frees, per_client=kind is not Kind.METHOD or doc.name in spec.per_client,
                 **common)  # type: ignore[arg-type]


def build_catalog(specs: Iterable[AdapterSpec], documents: dict[str, DocSurface] | None = None) -> Catalog:
    documents = documents if documents is not None else load_surfaces()
    catalog = Catalog(documents=documents)
    for spec in specs:
        surface = documents[spec.surface]
        module = importlib.import_module(spec.module)
        if spec.cls is None:
            for doc in surface.entries:
                catalog.add(_module_entry(spec, module, doc, surface))
        else:
            cls = getattr(module, spec.cls)
            catalog.types[f"{cls.__module__}.{cls.__qualname__}"] = cls
            if spec.finalizer is not None:
                catalog.finalizers[cls] = spec.finalizer
            if spec.lifecycle is not None:
                catalog.lifecycles[cls] = spec.lifecycle
            for doc in surface.entries:
                catalog.add(_class_entry(spec, cls, doc, surface))
        for ctor in spec.constructors:
            cls = getattr(importlib.import_module(ctor.module), ctor.attr)
            catalog.types[f"{cls.__module__}.{cls.__qualname__}"] = cls
            catalog.type_aliases[ctor.name] = cls      # a Record may name its type as its constructor is named
            catalog.add(Entry(name=ctor.name, kind=Kind.CONSTRUCTOR, module=ctor.module, class_name=ctor.attr,
                              attr="__init__", owner=cls, signature=_signature(cls), doc=None, result_ref=True))
        for final in spec.finalizers:
            final_cls = getattr(importlib.import_module(final.module), final.attr)
            catalog.finalizers[final_cls] = final.fn
            if final.expires:
                catalog.expiring.add(final_cls)
        for rule in spec.record_rules:
            catalog.rules[getattr(importlib.import_module(rule.module), rule.attr)] = rule
        for exposure in spec.exposures:
            catalog.exposures[getattr(importlib.import_module(exposure.module), exposure.attr)] = exposure
        for rec in spec.records:
            cls = getattr(importlib.import_module(rec.module), rec.attr)
            catalog.records[cls] = rec.fields
            if rec.constant:
                catalog.record_constants[cls] = frozenset(rec.constant)
        for grow in spec.growing:
            cls = getattr(importlib.import_module(grow.module), grow.attr)
            catalog.record_growing[cls] = frozenset(grow.fields)
    return catalog


# ------------------------------------------------------------------------------------ Describe
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
                                    default_repr=without_addresses(repr(p.default)) if has_default else "",
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
