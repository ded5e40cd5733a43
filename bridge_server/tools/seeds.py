"""Parse the generated Elixir binding documents (``shared/seeds``) into "surfaces".

Why this exists: these documents describe the Elixir bindings generated for vLLM 0.14.0, so
they are the contract for which names the bridge must expose. They come in two layouts -- a module
page with one heading per arity and bullet lists, and a "flattened" page whose headings were lost
and whose bullets run together on one line -- so this module normalises both into one small,
JSON-serialisable structure. The results are committed under ``adapters/surfaces/`` so that the
server never needs ``shared/`` at run time; ``tests/tools/test_seeds.py`` keeps them in step;
``adapters/surface.py`` holds the structure they are parsed into.

Regenerate with ``python -m bridge_server.tools.seeds SEEDS_DIR OUT_DIR``. Stdlib only on purpose: it
must run before (and without) the vLLM environment.
"""

from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from adapters.surface import DocEntry, DocParam, DocSurface, dumps

# Facts a document does not reliably state about itself, keyed by its file-name prefix (the hash
# part of the name may change when a document is regenerated). The document's own statements
# (title line, "Submodule bindings for X.", class signature line) override these. 002 never names
# its class: vLLM exports AsyncLLM as ``vllm.AsyncLLMEngine``, which is what the bindings call.
_DOCUMENTS: dict[str, tuple[str, str, str, str | None]] = {
    "000": ("forward_context", "Vllm.ForwardContext.Module", "vllm.forward_context", None),
    "002": ("async_llm", "Vllm.AsyncLLMEngine", "vllm", "AsyncLLMEngine"),
    "003": ("distributed", "Vllm.Distributed", "vllm.distributed", None),
    "004": ("dp_metadata", "Vllm.ForwardContext.DPMetadata", "vllm.forward_context", "DPMetadata"),
}

# Flattened prose bullets sometimes lose the boundary between one parameter's description and the
# next parameter's name ("...data parallel workersdrain_timeout- Maximum..."). Text alone cannot
# say where the word ends, so the known cases are listed; an unknown one is an error, not a guess.
_GLUED_NAMES: dict[str, str] = {
    "workersdrain_timeout": "drain_timeout",  # 002 scale_elastic_ep
    "tensorcontiguous_split_chunks": "contiguous_split_chunks",  # 003 split_tensor_along_last_dim
}

_RECEIVER = "SnakeBridge.Ref.t()"  # first spec argument of a method: the object, not a parameter
_OPTS = "keyword()"
_VARIADIC = "[term()]"  # class documents: the list of optional positional arguments
_SECTIONS = {"Parameters": "params", "Returns": "returns", "Examples": "other"}
_HEADING = re.compile(r"([A-Za-z_]\w*[?!]?)\((.*)\)")
_SPEC = re.compile(r"@spec\s+([A-Za-z_]\w*[?!]?)\s*\(")
_IDENT = re.compile(r"[A-Za-z_]\w*")
_PROSE = re.compile(r"^[A-Za-z_]\w* ?- |[A-Za-z_]\w*- ")
_RETURNS_PROSE = re.compile(r"Returns (.+?)\.(?:\s|$)")


@dataclass
class _Raw:
    """What the text says about one name before it is interpreted."""

    name: str
    specs: list[list[str]] = field(default_factory=list)
    headings: list[list[str]] = field(default_factory=list)
    summary: str | None = None
    param_lines: list[str] = field(default_factory=list)
    returns: str | None = None


def _close(text: str, start: int) -> int:
    """Index of the bracket closing the one at ``start``, or -1 (types nest (), [] and {})."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] in "([{":
            depth += 1
        elif text[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _split_top(text: str) -> list[str]:
    """Split on commas outside brackets: ``{term(), term()}, integer()`` is two arguments."""
    parts: list[str] = []
    depth, cur = 0, ""
    for ch in text:
        depth += (ch in "([{") - (ch in ")]}")
        if ch == "," and depth == 0:
            parts.append(cur.strip())
            cur = ""
        else:
            cur += ch
    parts.append(cur.strip())
    return [p for p in parts if p]


def _spec_complete(text: str) -> bool:
    """A module document wraps long specs over several lines; this says when one has ended."""
    depth = sum(text.count(c) for c in "([{") - sum(text.count(c) for c in ")]}")
    tail = text.rstrip()
    return depth == 0 and "::" in text and not tail.endswith(("::", "|"))


def _is_heading(lines: list[str], i: int) -> bool:
    """A heading is ``name(args)`` directly followed by a ``@spec`` of the same name.

    The name check matters: in flattened documents a return type (``term()``) or a one-line
    parameter list (``a(term())b(term())``) also looks like ``name(...)`` before a ``@spec``.
    """
    m = _HEADING.fullmatch(lines[i])
    spec = _SPEC.match(lines[i + 1]) if m and i + 1 < len(lines) else None
    return m is not None and spec is not None and spec[1] == m[1]


def _returns_text(line: str) -> str:
    """The return type; one entry of 003 writes prose ("Returns boolean(). True if ...")."""
    m = _RETURNS_PROSE.match(line)
    return m[1] if m else line


def _collect(text: str) -> list[_Raw]:
    """Walk the entry part of a document (after its preamble and summary list) name by name."""
    lines = []
    for line in text.splitlines():
        line = line.strip()
        line = line[1:].strip() if line.startswith("\u2022") else line
        if line:
            lines.append(line)
    start = next((i for i, line in enumerate(lines) if line.startswith("@spec")), len(lines))
    if start > 0 and _is_heading(lines, start - 1):
        start -= 1
    raws: dict[str, _Raw] = {}
    cur: _Raw | None = None
    section, i = "desc", start
    while i < len(lines):
        line = lines[i]
        if line.startswith("@spec"):
            j = i + 1
            while not _spec_complete(line) and j < len(lines):
                line, j = line + " " + lines[j], j + 1
            m = _SPEC.match(line)
            if m is None:
                raise ValueError(f"unreadable @spec: {line!r}")
            if cur is None or cur.name != m[1]:
                cur = raws.setdefault(m[1], _Raw(m[1]))
            cur.specs.append(_split_top(line[m.end():_close(line, m.end() - 1)]))
            section, i = "desc", j
            continue
        if _is_heading(lines, i):
            hm = _HEADING.fullmatch(line)
            assert hm is not None
            cur = raws.setdefault(hm[1], _Raw(hm[1]))
            cur.headings.append(_split_top(hm[2]))
            section = "desc"
        elif line in _SECTIONS:
            # Only the first Parameters section of a name counts (later arities repeat nothing).
            repeat = line == "Parameters" and cur is not None and bool(cur.param_lines)
            section = "other" if repeat else _SECTIONS[line]
        elif cur is not None:
            if section == "desc" and cur.summary is None:
                cur.summary = line
            elif section == "params":
                cur.param_lines.append(line)
            elif section == "returns" and cur.returns is None:
                cur.returns = _returns_text(line)
        i += 1
    return list(raws.values())


def _typed_params(line: str) -> list[DocParam] | None:
    """Parse ``a(t())b(t() keyword-only default: X)`` or ``a (t())``; None if it is prose."""
    out: list[DocParam] = []
    pos = 0
    while pos < len(line):
        m = _IDENT.match(line, pos)
        if m is None:
            return None
        opening = m.end() + (1 if line.startswith(" (", m.end()) else 0)
        closing = _close(line, opening) if line.startswith("(", opening) else -1
        if closing < 0:
            return None
        kind, sep, default = line[opening + 1:closing].partition(" default: ")
        keyword_only = kind.endswith(" keyword-only")
        kind = kind.removesuffix(" keyword-only").strip()
        out.append(DocParam(m[0], kind, bool(sep), default.strip() if sep else None,
                            keyword_only))
        pos = closing + 1
        while line.startswith(" ", pos):
            pos += 1
    return out or None


def _prose_names(line: str) -> list[str]:
    """Names from ``name- description`` bullets, also when several share one line."""
    names = []
    for m in _PROSE.finditer(line):
        token = m[0].rstrip("- ")
        if m.start() > 0 and line[m.start() - 1].isspace():  # glued to the previous description
            if token not in _GLUED_NAMES:
                raise ValueError(f"cannot split parameter name from description: {token!r}")
            token = _GLUED_NAMES[token]
        names.append(token)
    return names


def _entry(raw: _Raw, is_class: bool) -> DocEntry:
    """Interpret one name: arities from specs/headings, params from bullets (specs fill gaps)."""
    arities: set[int] = set()
    shapes: list[tuple[list[str], bool, bool]] = []  # (positional types, has opts, variadic)
    for args in raw.specs:
        arities.add(len(args))
        rest = args[1:] if args[:1] == [_RECEIVER] else list(args)
        opts = bool(rest) and rest[-1] == _OPTS
        if opts:
            rest.pop()
            arities.add(len(args) - 1)
        variadic = is_class and bool(rest) and rest[-1] == _VARIADIC
        if variadic:
            rest.pop()
        shapes.append((rest, opts, variadic))
    for heading in raw.headings:
        arities.add(len(heading))
        if heading and heading[-1].replace(" ", "") == "opts\\\\[]":
            arities.add(len(heading) - 1)
    summary = raw.summary or ""
    bare = all(not rest and not opts and not variadic for rest, opts, variadic in shapes)
    attribute = summary.startswith("Python module attribute ") or (
        bool(shapes) and bare and not raw.param_lines and not any(raw.headings))

    typed = [_typed_params(line) for line in raw.param_lines]
    if all(t is not None for t in typed):
        params = tuple(p for t in typed if t is not None for p in t)
    else:
        # Prose bullets: names from the widest heading (module pages) or the bullets; types,
        # optionality and keyword-only-ness from the specs, where they line up with the names.
        names: list[str] = []
        for line, t in zip(raw.param_lines, typed):
            names += [p.name for p in t] if t is not None else _prose_names(line)
        if raw.headings:
            names = [a for a in max(raw.headings, key=len) if a.split()[0] != "opts"]
        positional = max((s[0] for s in shapes), key=len, default=[])
        required = min((len(s[0]) for s in shapes), default=0)
        variadic = any(s[2] for s in shapes)
        aligned = len(names) >= len(positional)  # fewer names than slots: the prose is stale
        params = tuple(
            DocParam(name, positional[i] if aligned and i < len(positional) else "term()",
                     i >= required, None, is_class and not variadic and i >= len(positional))
            for i, name in enumerate(names))
    return DocEntry(raw.name, tuple(sorted(arities)), params, raw.returns or "", summary,
                    attribute)


def parse_document(name: str, text: str) -> DocSurface:
    """Parse one binding document; ``name`` is its file name (its prefix selects known facts)."""
    _key, elixir, python_module, python_class = _DOCUMENTS.get(name[:3], ("", "", "", None))
    is_class = _RECEIVER in text
    title = re.search(r"^(Vllm(?:\.\w+)+)(?: \(|\.some_function\()", text, re.M)
    elixir = title[1] if title else elixir
    sub = re.search(r"^Submodule bindings for ([\w.]+?)\.$", text, re.M)
    python_module = sub[1] if sub else python_module
    signature = re.match(r"([A-Z]\w*)\(", text.lstrip()) if is_class else None
    python_class = signature[1] if signature else python_class
    entries = tuple(_entry(raw, is_class) for raw in _collect(text))
    return DocSurface(name, elixir, python_module, python_class, entries)


def load_surfaces(seeds_dir: Path) -> dict[str, DocSurface]:
    """Parse the known binding documents of ``seeds_dir``, keyed by surface key (001 is not one)."""
    surfaces: dict[str, DocSurface] = {}
    for prefix, (key, *_rest) in _DOCUMENTS.items():
        found = sorted(seeds_dir.glob(f"{prefix}_*.txt"))
        if len(found) != 1:
            raise FileNotFoundError(f"expected one {prefix}_*.txt in {seeds_dir}, found {found}")
        surfaces[key] = parse_document(found[0].name, found[0].read_text(encoding="utf-8"))
    return surfaces


def main(argv: list[str] | None = None) -> int:
    """``python -m bridge_server.tools.seeds SEEDS_DIR OUT_DIR``: write ``OUT_DIR/<key>.json``."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m bridge_server.tools.seeds SEEDS_DIR OUT_DIR", file=sys.stderr)
        return 2
    out_dir = Path(args[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    for key, surface in load_surfaces(Path(args[0])).items():
        (out_dir / f"{key}.json").write_text(dumps(surface), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
