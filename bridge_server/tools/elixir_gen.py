"""Generate the Elixir binding modules (`Vllm.Distributed`, `Vllm.AsyncLLMEngine`, ...) of the Mix
project in `mix_client_example/` from the server's catalog.

Why generated: the binding documents fix what Elixir users write (module names, function names,
arities, argument layout); the catalog (`Describe`) fixes what the server serves (target kinds,
streaming, the installed signatures). Joining the two by hand would drift the first time either
changes, so this joins them mechanically, refuses any documented name the catalog does not serve
(and any served name no document binds), and writes deterministic text that is committed and
checked by `tests/tools/test_elixir_bindings.py`.

Argument layouts follow the documents' own conventions so documented calls work as
written: module functions take each optional parameter as one more arity, where the last argument
may instead be the keyword list of options; class members take the receiver first and the optional
positional parameters as one list. Every function also accepts a trailing keyword list (`__runtime__`
plus Python keyword arguments), except attribute reads, which the documents give arity 0 or 1.

    vllm-bridge gen-elixir [--address HOST:PORT] [--out mix_client_example/lib/vllm]
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from adapters.surface import SURFACES_DIR, DocEntry, DocSurface, load_surfaces
from vllm_bridge.v1 import bridge_pb2 as pb

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = ROOT / "mix_client_example" / "lib" / "vllm"
CE = pb.CatalogEntry
_RESERVED = {"do", "end", "fn", "when", "in", "not", "and", "or", "nil", "true", "false", "catch", "rescue",
             "after", "else", "ref", "opts", "args"}
_KEEP_TYPES = {"String", "MapSet"}      # remote types that exist in every Elixir; others become term()
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")  # object reprs in defaults: not deterministic
# What a method is called on: a ref, or the name of an object the server published (a string or an atom).
RECEIVER = "VllmBridge.Ref.t() | String.t() | atom()"


@dataclass(frozen=True)
class Clause:
    """One Elixir function head: its parameters and the body expression that calls the server."""

    params: tuple[str, ...]
    types: tuple[str, ...]
    body: str
    guard: str = ""


@dataclass(frozen=True)
class Binding:
    """One documented name, resolved against the catalog, with every arity it is generated at."""

    doc: DocEntry
    entry: pb.CatalogEntry
    clauses: tuple[Clause, ...]

    @property
    def arities(self) -> tuple[int, ...]:
        return tuple(len(c.params) for c in self.clauses)


def prefix(surface: DocSurface) -> str:
    """The catalog prefix of a document: its module, or module.Class for class documents."""
    return f"{surface.python_module}.{surface.python_class}" if surface.python_class else surface.python_module


def catalog_name(surface: DocSurface, doc: DocEntry) -> str:
    """A class document's `new` is its constructor, named by the class itself."""
    if surface.python_class and doc.name == "new":
        return prefix(surface)
    return f"{prefix(surface)}.{doc.name}"


def var(name: str, taken: set[str]) -> str:
    """An Elixir variable for a Python parameter name (`A_scale` -> `a_scale`, `end` -> `end_`)."""
    v = name[0].lower() + name[1:] if name else "arg"
    v = re.sub(r"\W", "_", v)
    while v in _RESERVED or v in taken:
        v += "_"
    taken.add(v)
    return v


def elixir_type(doc_type: str, own: str = "") -> str:
    """A documented type usable in a @spec: types of modules this project lacks become term(); the
    class's own type (`own`, e.g. `Vllm.ForwardContext.DPMetadata`) is the module's `t()`."""
    t = doc_type.strip() or "term()"
    if own and t == f"{own}.t()":
        return "t()"
    t = t.replace("SnakeBridge.Ref.t()", "VllmBridge.Ref.t()")
    modules = set(re.findall(r"(?<![\w.])([A-Z]\w*(?:\.[A-Z]\w*)*)\.t\(", t))
    if any(m.split(".")[0] not in _KEEP_TYPES and m != "VllmBridge.Ref" for m in modules):
        return "term()"
    return t


def module_clauses(doc: DocEntry, target: str, mode: str) -> list[Clause]:
    """Module functions: arity r..n positional (the last optional one may be the options), n+1 with opts."""
    if doc.attribute:
        return [Clause((), (), f"B.invoke(:call, {target}, [], [])")]
    slots = [p for p in doc.params if not p.keyword_only]
    required = sum(not p.has_default for p in slots)
    if doc.arities and min(doc.arities) < required:   # documented as *args/**kwargs: no positional slots
        slots, required = [], 0
    taken: set[str] = set()
    names = [var(p.name, taken) for p in slots]
    types = [elixir_type(p.type) for p in slots]
    out = []
    for n in range(required, len(slots) + 1):
        args = f"[{', '.join(names[:n])}]"
        if n > required:
            out.append(Clause(tuple(names[:n]), (*types[:n - 1], f"{types[n - 1]} | keyword()"),
                              f"B.invoke(:{mode}, {target}, B.tail({args}))"))
        else:
            out.append(Clause(tuple(names[:n]), tuple(types[:n]), f"B.invoke(:{mode}, {target}, {args}, [])"))
    out.append(Clause((*names, "opts"), (*types, "keyword()"),
                      f"B.invoke(:{mode}, {target}, [{', '.join(names)}], opts)", "is_list(opts)"))
    return out


def class_clauses(doc: DocEntry, entry: pb.CatalogEntry, surface: DocSurface, mode: str) -> list[Clause]:
    """Class members: receiver first (not for `new`), required params, the optional ones as a list, opts."""
    qualified = catalog_name(surface, doc)
    if entry.kind == CE.ATTRIBUTE:
        body = f'B.invoke(:call, {{:get_attr, ref, "{doc.name}"}}, [], [])'
        return [Clause(("ref",), (RECEIVER,), body)]
    receiver: tuple[str, ...] = ()
    rtypes: tuple[str, ...] = ()
    if entry.kind == CE.CONSTRUCTOR:
        target = f'{{:constructor, "{qualified}"}}'
    elif entry.kind == CE.CLASSMETHOD:
        receiver, rtypes = ("ref",), (RECEIVER,)
        target = f'B.classmethod(ref, "{doc.name}", "{qualified}")'
    else:
        receiver, rtypes = ("ref",), (RECEIVER,)
        target = f'{{:method, ref, "{doc.name}"}}'
    # Documented to return an instance of its own class (what `new` returns): the record the server
    # sends by value is built into one (`B.instance/3`), under the call's runtime options.
    wrap = (lambda call, opts: f'B.instance({call}, "{prefix(surface)}", {opts})') \
        if entry.kind != CE.CONSTRUCTOR and returns_own(doc, surface) else (lambda call, opts: call)
    positional = [p for p in doc.params if not p.keyword_only]
    required = [p for p in positional if not p.has_default]
    taken: set[str] = set()
    names = tuple(var(p.name, taken) for p in required)
    types = (*rtypes, *(elixir_type(p.type) for p in required))
    head, req = (*receiver, *names), f"[{', '.join(names)}]"
    out = [Clause(head, types, wrap(f"B.invoke(:{mode}, {target}, {req}, [])", "[]"))]
    if len(required) < len(positional):
        out.append(Clause((*head, "args"), (*types, "list()"),
                          wrap(f"B.invoke(:{mode}, {target}, B.rest({req}, args))", "args"), "is_list(args)"))
        out.append(Clause((*head, "args", "opts"), (*types, "list()", "keyword()"),
                          wrap(f"B.invoke(:{mode}, {target}, {f'{req} ++ args' if names else 'args'}, opts)", "opts"),
                          "is_list(args) and is_list(opts)"))
    else:
        out.append(Clause((*head, "opts"), (*types, "keyword()"),
                          wrap(f"B.invoke(:{mode}, {target}, {req}, opts)", "opts"), "is_list(opts)"))
    return out


def returns_own(doc: DocEntry, surface: DocSurface) -> bool:
    """Whether a class member is documented to return an instance of its own class (`t()`)."""
    return bool(surface.python_class) and doc.returns.strip() in (f"{surface.elixir_module}.t()", "t()")


def bind(surface: DocSurface, catalog: Mapping[str, pb.CatalogEntry]) -> list[Binding]:
    """Every documented name of a surface with its clauses; fails on any mismatch with the catalog."""
    out = []
    for doc in sorted(surface.entries, key=lambda d: d.name):
        name = catalog_name(surface, doc)
        entry = catalog.get(name)
        if entry is None:
            raise ValueError(f"{surface.document}: {name} is documented but the catalog does not serve it")
        mode = "stream" if entry.streams else "call"
        if surface.python_class:
            clauses = class_clauses(doc, entry, surface, mode)
        else:
            kind = ":module_attr" if entry.kind == CE.MODULE_ATTR else ":function"
            clauses = module_clauses(doc, f'{{{kind}, "{name}"}}', mode)
        binding = Binding(doc, entry, tuple(clauses))
        missing = set(doc.arities) - set(binding.arities)
        if missing:
            raise ValueError(f"{name}: documented arities {sorted(missing)} cannot be generated "
                             f"(generated {list(binding.arities)})")
        out.append(binding)
    served = {e.name for e in catalog.values() if e.documented_in == surface.document}
    unbound = served - {b.entry.name for b in out}
    if unbound:
        raise ValueError(f"{surface.document}: catalog entries no document binds: {sorted(unbound)}")
    return out


def _doc_text(b: Binding) -> str:
    """@doc body: what the server runs, the documented parameters, the installed extras, the layout."""
    e, d = b.entry, b.doc
    lines = [d.summary or f"Python `{e.name}`.", "", f"Calls `{e.name}` ({CE.Kind.Name(e.kind).lower()})"
             + (", streaming: returns `{:ok, stream}`, a lazy `Stream` that cancels the call if stopped early."
                if e.streams else ".")]
    installed = {p.name: p for p in e.parameters}
    if d.params:
        lines += ["", "Parameters:", ""]
        for p in d.params:
            default = p.default if p.default is not None else (
                installed[p.name].default_repr if p.name in installed and installed[p.name].has_default else None)
            extra = (" keyword-only" if p.keyword_only else "") + (f", default `{_ADDRESS.sub('', default)}`"
                                                                   if default is not None else "")
            lines.append(f"  * `{p.name}` ({p.type or 'term()'}{extra})")
    documented = {p.name for p in d.params}
    extras = [p.name for p in e.parameters if p.name not in documented
              and p.kind not in (pb.Parameter.VAR_POSITIONAL, pb.Parameter.VAR_KEYWORD)]
    if extras and d.params:
        lines += ["", "Also accepted as keywords (installed signature): " + ", ".join(f"`{x}`" for x in extras) + "."]
    if d.returns:
        lines += ["", f"Returns `{d.returns}`."]
    lines += ["", "Documented arities: " + ", ".join(map(str, d.arities)) + "."]
    return "\n".join(lines).replace('"""', '\\"\\"\\"')


def _function(b: Binding, surface: DocSurface) -> list[str]:
    own = surface.elixir_module if surface.python_class else ""
    returns = "Enumerable.t()" if b.entry.streams else (
        "t()" if b.entry.kind == CE.CONSTRUCTOR and own else elixir_type(b.doc.returns, own))
    name = b.doc.name
    out = ["", '  @doc ~S"""', *[f"  {x}".rstrip() for x in _doc_text(b).split("\n")], '  """']
    for c in b.clauses:
        out.append(f"  @spec {name}({', '.join(c.types)}) :: {{:ok, {returns}}} | {{:error, VllmBridge.Error.t()}}")
    for c in b.clauses:
        guard = f" when {c.guard}" if c.guard else ""
        out.append(f"  def {name}({', '.join(c.params)}){guard}, do: {c.body}")
    return out


def render(surface: DocSurface, bindings: Sequence[Binding], vllm_version: str) -> str:
    """One Elixir module; the text depends only on the catalog and the documents (no dates, no paths)."""
    what = f"class `{prefix(surface)}`" if surface.python_class else f"module `{surface.python_module}`"
    head = [
        "# Generated by `vllm-bridge gen-elixir` from the server's catalog and the binding documents.",
        "# Do not edit: regenerate instead (tests/tools/test_elixir_bindings.py fails when this is stale).",
        f"defmodule {surface.elixir_module} do",
        '  @moduledoc ~S"""',
        f"  Bindings for the Python {what} (vLLM {vllm_version}), as documented in `{surface.document}`.",
        "",
        "  Every function returns `{:ok, value}` or `{:error, %VllmBridge.Error{}}` and takes a trailing",
        "  keyword list: `__runtime__: [...]` holds the runtime options (`timeout`, `timeout_profile`,",
        "  `stream_timeout`, `session_id`, `pool_name`, `affinity`, `server`...; see `VllmBridge`), every",
        "  other keyword is a Python keyword argument.",
    ]
    if surface.python_class:
        head += ["", "  Methods take the receiver first: a `VllmBridge.Ref` or the name of a published object",
                 "  (`\"engine\"` or `:engine`). Optional positional parameters go in one list after the required",
                 "  ones."]
    else:
        head += ["", "  Each optional parameter is one more arity; in those arities the last argument may instead",
                 "  be the keyword list of options."]
    head += ['  """', "", "  alias VllmBridge.Binding, as: B"]
    if surface.python_class:
        typedoc = f"An instance of `{prefix(surface)}` on the server: a ref to it (what `new` returns)."
        head += ["", f'  @typedoc "{typedoc}"', "  @type t :: VllmBridge.Ref.t()"]
    body = [line for b in bindings for line in _function(b, surface)]
    return "\n".join(head + body + ["end", ""])


def module_path(elixir_module: str) -> Path:
    """`Vllm.ForwardContext.DPMetadata` -> `forward_context/dp_metadata.ex` (as Macro.underscore does)."""
    parts = elixir_module.split(".")[1:]
    snake = [re.sub(r"([A-Z]+)([A-Z][a-z])", r"\1_\2", re.sub(r"([a-z\d])([A-Z])", r"\1_\2", p)).lower() for p in parts]
    return Path(*snake[:-1], snake[-1] + ".ex")


def generate(catalog: pb.Catalog, surfaces: Mapping[str, DocSurface] | None = None) -> dict[Path, str]:
    """Relative path -> file text, for every documented surface."""
    entries = {e.name: e for e in catalog.entries}
    version = catalog.vllm_version.split("+")[0]
    out = {}
    for surface in sorted((surfaces or load_surfaces()).values(), key=lambda s: s.elixir_module):
        out[module_path(surface.elixir_module)] = render(surface, bind(surface, entries), version)
    return out


def local_catalog() -> pb.Catalog:
    """The catalog a worker would serve, built in this process (imports vLLM: a few seconds)."""
    from bridge_server.worker.catalog import describe
    from bridge_server.worker.server import default_catalog
    return describe(default_catalog())


def write(files: Mapping[Path, str], out: Path) -> list[Path]:
    """Writes the files; removes generated `.ex` files under `out` that are no longer generated."""
    written = []
    for rel, text in files.items():
        path = out / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if not path.exists() or path.read_text(encoding="utf-8") != text:
            path.write_text(text, encoding="utf-8")
        written.append(path)
    for stale in set(out.rglob("*.ex")) - set(written):
        if stale.read_text(encoding="utf-8").startswith("# Generated by `vllm-bridge gen-elixir`"):
            stale.unlink()
    return written


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="vllm-bridge gen-elixir", description=__doc__.split("\n\n")[0])
    p.add_argument("--address", default=None, help="read the catalog from this server (default: build it here)")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="folder of the Vllm.* modules (default %(default)s)")
    p.add_argument("--surfaces", type=Path, default=SURFACES_DIR, help="parsed binding documents (default %(default)s)")
    args = p.parse_args(argv)
    if args.address:
        from bridge_server.client.client import BridgeClient
        with BridgeClient(args.address) as client:
            catalog = client.describe()
    else:
        catalog = local_catalog()
    for path in write(generate(catalog, load_surfaces(args.surfaces)), args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
