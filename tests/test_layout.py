"""The layout is the system's shape: one folder per place code runs, and dependencies that point one way.

Every import of every module under `bridge_server/` and `adapters/` is read (those inside functions
too, which is where lazy imports hide), and the rules the README's map states are checked:

- the worker and the pool server never import each other: they talk only through the protocol;
- clients import only the wire package; the wire package imports none of the others;
- adapters import only the wire package (the worker loads them, never the other way round);
- the subpackages form no cycle;
- no module imports another module's private names;
- at most three modules stand directly in `bridge_server/`.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from tests.conftest import ROOT

PACKAGE = ROOT / "bridge_server"
ROLES = ("wire", "worker", "pool", "client", "tools")
# What each part may import, besides itself (and the standard library, third parties and the
# generated `vllm_bridge` stubs). The top-level modules (cli.py, __main__.py) are the entry point
# of every role and may import anything.
ALLOWED: dict[str, set[str]] = {
    "wire": set(),
    "adapters": {"wire"},
    "worker": {"wire", "adapters"},
    "pool": {"wire"},
    "client": {"wire"},
    "tools": {"wire", "adapters", "worker", "client"},
}


def part_of(module: str) -> str | None:
    """Which part a dotted module name belongs to (None: not ours, or a top-level module)."""
    parts = module.split(".")
    if parts[0] == "adapters":
        return "adapters"
    if parts[0] == "bridge_server" and len(parts) > 1 and parts[1] in ROLES:
        return parts[1]
    return None


def modules() -> Iterator[tuple[str, Path]]:
    for path in sorted([*PACKAGE.rglob("*.py"), *(ROOT / "adapters").rglob("*.py")]):
        rel = path.relative_to(ROOT).with_suffix("")
        yield ".".join(p for p in rel.parts if p != "__init__"), path


def imports(path: Path) -> Iterator[tuple[str, list[str], int]]:
    """(module imported, names taken from it, line) for every import statement, at any depth."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, [], node.lineno
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [a.name for a in node.names]
            yield node.module, names, node.lineno
            for name in names:   # `from bridge_server.worker import main` imports a module too
                yield f"{node.module}.{name}", [], node.lineno


def dependencies() -> dict[str, dict[str, list[str]]]:
    """part -> part it imports -> where ("module:line")."""
    found: dict[str, dict[str, list[str]]] = {}
    for name, path in modules():
        src = part_of(name)
        if src is None:
            continue
        for imported, _names, line in imports(path):
            dst = part_of(imported)
            if dst is not None and dst != src:
                found.setdefault(src, {}).setdefault(dst, []).append(f"{name}:{line}")
    return found


def test_every_module_belongs_to_a_role_folder() -> None:
    top = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(top) <= 3, f"modules directly in bridge_server/: {top}"
    assert set(top) <= {"__init__.py", "__main__.py", "cli.py"}
    folders = sorted(p.name for p in PACKAGE.iterdir() if p.is_dir() and (p / "__init__.py").exists())
    assert folders == sorted(ROLES)


def test_dependencies_point_one_way() -> None:
    deps = dependencies()
    assert deps, "no dependencies found: the scan is broken"
    wrong = [f"{src} imports {dst} ({', '.join(where[:3])})"
             for src, targets in deps.items() for dst, where in targets.items() if dst not in ALLOWED[src]]
    assert not wrong, "\n".join(wrong)


def test_the_worker_and_the_pool_server_never_import_each_other() -> None:
    deps = dependencies()
    assert "pool" not in deps.get("worker", {}), deps.get("worker", {}).get("pool")
    assert "worker" not in deps.get("pool", {}), deps.get("pool", {}).get("worker")
    for part in ("worker", "pool", "tools", "adapters"):
        assert part not in deps.get("client", {}), f"client imports {part}: {deps['client'][part]}"


def test_no_cycle_between_parts() -> None:
    graph = {src: set(targets) for src, targets in dependencies().items()}

    def reach(start: str) -> set[str]:
        seen: set[str] = set()
        todo = list(graph.get(start, ()))
        while todo:
            node = todo.pop()
            if node not in seen:
                seen.add(node)
                todo.extend(graph.get(node, ()))
        return seen

    cycles = [part for part in graph if part in reach(part)]
    assert not cycles, f"parts on a cycle: {cycles} (graph: {graph})"


def test_no_module_takes_another_modules_private_names() -> None:
    private = [f"{name}:{line} takes {n} from {imported}"
               for name, path in modules() for imported, names, line in imports(path)
               if part_of(imported) is not None or imported.startswith("bridge_server")
               for n in names if n.startswith("_")]
    assert not private, "\n".join(private)


def test_the_scan_sees_lazy_imports() -> None:
    """The check is only worth something if imports inside functions count: the CLI's are all lazy."""
    lazy = [imported for imported, _names, _line in imports(PACKAGE / "cli.py")]
    assert "bridge_server.tools.tiny_model" in lazy and "bridge_server.worker.server" in lazy
