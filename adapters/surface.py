"""The binding documents' surfaces: which names each document lists, with their parameters, arities
and return types, as parsed from `../shared/seeds` by `bridge_server/tools/seeds.py` and committed
in `adapters/surfaces/*.json`.

The server reads only the committed files (it never needs `shared/` at run time): the catalog takes
its names from them, and the Elixir generator its functions. Stdlib only: the parser runs before
(and without) the vLLM environment.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SURFACES_DIR = Path(__file__).resolve().parent / "surfaces"


@dataclass(frozen=True)
class DocParam:
    """One documented Python parameter.

    ``default`` is the documented text (``"None"``, ``"0"``, ``"()"``...). ``has_default`` with
    ``default is None`` means the binding makes the parameter optional but the document does not
    say what the default is (prose-only parameter lists).
    """

    name: str
    type: str
    has_default: bool
    default: str | None
    keyword_only: bool


@dataclass(frozen=True)
class DocEntry:
    """One documented function, method, property or module attribute.

    ``arities`` are the Elixir arities the bindings define, as the ``@spec`` lines (and headings)
    show them: the receiver ``ref`` and the trailing ``opts`` count, and a spec ending in
    ``keyword()`` also implies arity ``n - 1`` because ``opts`` defaults to ``[]``.
    """

    name: str
    arities: tuple[int, ...]
    params: tuple[DocParam, ...]
    returns: str
    summary: str
    attribute: bool


@dataclass(frozen=True)
class DocSurface:
    """Everything one binding document says: where it binds to and which names it lists."""

    document: str
    elixir_module: str
    python_module: str
    python_class: str | None
    entries: tuple[DocEntry, ...]


def to_json(surface: DocSurface) -> dict[str, Any]:
    """Plain JSON-ready dict (lists, not tuples) so it compares equal to ``json.load`` output."""
    return {
        "document": surface.document,
        "elixir_module": surface.elixir_module,
        "python_module": surface.python_module,
        "python_class": surface.python_class,
        "entries": [
            {"name": e.name, "arities": list(e.arities), "returns": e.returns,
             "summary": e.summary, "attribute": e.attribute,
             "params": [{"name": p.name, "type": p.type, "has_default": p.has_default,
                         "default": p.default, "keyword_only": p.keyword_only}
                        for p in e.params]}
            for e in surface.entries],
    }


def from_json(d: dict[str, Any]) -> DocSurface:
    """Inverse of :func:`to_json`, for code that reads the committed surfaces."""
    return DocSurface(
        d["document"], d["elixir_module"], d["python_module"], d["python_class"],
        tuple(DocEntry(e["name"], tuple(e["arities"]),
                       tuple(DocParam(p["name"], p["type"], p["has_default"], p["default"],
                                      p["keyword_only"]) for p in e["params"]),
                       e["returns"], e["summary"], e["attribute"])
              for e in d["entries"]))


def dumps(surface: DocSurface) -> str:
    """The exact committed file text: sorted keys, indent 2, trailing newline."""
    return json.dumps(to_json(surface), sort_keys=True, indent=2) + "\n"


def load_surfaces(directory: Path = SURFACES_DIR) -> dict[str, DocSurface]:
    """The committed surfaces, keyed by file stem (the surface key an adapter names)."""
    return {p.stem: from_json(json.loads(p.read_text(encoding="utf-8"))) for p in sorted(directory.glob("*.json"))}
