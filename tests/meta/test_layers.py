"""The layers of docs/architecture.md ("The parts"), held by reading every import under sidecar/.

Every import counts: module level, inside a function, and under ``if TYPE_CHECKING:`` (a type
is a dependency too). Three rules:

- a module imports only from its own package or from a package of a lower layer (``LAYERS``,
  bottom first); the one exception is the DLQ's face to the proxy (``FACES``);
- no import cycle between modules;
- no class name is defined twice under sidecar/ (one source for every name).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

import pytest

pytestmark = pytest.mark.once  # the same result in either build: CI's compiled pass leaves it out

ROOT = Path(__file__).resolve().parents[2]
SIDECAR = ROOT / "sidecar"

# Bottom first; a package imports only from the layers below its own. "__init__" is
# sidecar/__init__.py (the version and the build); the other names are sidecar/<name>/ or
# sidecar/<name>.py. Kept in step with docs/architecture.md.
LAYERS: tuple[frozenset[str], ...] = (
    frozenset({"outcomes"}),
    frozenset({"core"}),
    frozenset(
        {
            "__init__",
            "config",
            "lifecycle",
            "heaptrim",
            "heapfreeze",
            "h2quiet",
            "jsonapi",
            "testing",
        }
    ),
    frozenset({"retry", "upstream", "telemetry", "fleet"}),
    frozenset({"engine", "explain"}),
    frozenset({"proxy", "dlq", "idempotency"}),
    frozenset({"admin"}),
    frozenset({"app"}),
    frozenset({"demo"}),
    frozenset({"cli"}),
    frozenset({"__main__"}),
)

# What a package may import from a package of its own layer: the proxy calls the DLQ's capture
# (with what a stored write is, and the store it writes to), nothing else of the DLQ; and the
# idempotency guard (with its settings, the answers it takes and gives, and the store's
# contract), nothing else of the idempotency package.
FACES: dict[tuple[str, str], frozenset[str]] = {
    ("proxy", "dlq"): frozenset(
        {"sidecar.dlq.capture", "sidecar.dlq.record", "sidecar.dlq.contract"}
    ),
    ("proxy", "idempotency"): frozenset(
        {
            "sidecar.idempotency.guard",
            "sidecar.idempotency.holding",
            "sidecar.idempotency.answer",
            "sidecar.idempotency.outcome",
            "sidecar.idempotency.policy",
            "sidecar.idempotency.store",
        }
    ),
}


@dataclass(frozen=True)
class Import:
    source: str  # the importing module, dotted
    target: str  # the imported module, dotted
    where: str  # file:line of the import statement


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(SIDECAR.rglob("*.py"))}


def package(module: str) -> str:
    """``sidecar.engine.loop`` -> ``engine``; ``sidecar.app`` -> ``app``; ``sidecar`` ->
    ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def imports(known: dict[str, Path]) -> Iterator[Import]:
    """Every import of a project module, wherever it stands in the file."""
    for source, path in known.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in known:
                        yield Import(source, alias.name, where)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = source.split(".")[: len(source.split(".")) - node.level + is_package]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                # ``from sidecar.engine import loop`` imports the module sidecar.engine.loop
                subs = {f"{base}.{a.name}" for a in node.names}
                targets = {sub if sub in known else base for sub in subs}
                for target in sorted(targets & known.keys()):
                    yield Import(source, target, where)


def rank(pkg: str) -> int | None:
    for i, layer in enumerate(LAYERS):
        if pkg in layer:
            return i
    return None


def test_every_package_has_a_layer():
    missing = sorted(
        f"{path.relative_to(ROOT)}: package {package(m)!r} has no layer in LAYERS "
        "(place it there and in docs/architecture.md)"
        for m, path in modules().items()
        if rank(package(m)) is None
    )
    assert not missing, "\n".join(missing)


def test_each_package_imports_only_the_layers_below_it():
    known = modules()
    broken = []
    for imp in imports(known):
        src, dst = package(imp.source), package(imp.target)
        rs, rd = rank(src), rank(dst)
        if src == dst or rs is None or rd is None or rd < rs:
            continue
        if imp.target in FACES.get((src, dst), frozenset()):
            continue
        rule = (
            f"{dst} is in the same layer ({rs}) and only {sorted(FACES[(src, dst)])} is its face"
            if (src, dst) in FACES
            else f"{src} (layer {rs}) imports only from layers below it; {dst} is layer {rd}"
        )
        broken.append(f"{imp.where}: {imp.source} imports {imp.target}: {rule}")
    assert not broken, "\n".join(broken)


def test_no_import_cycle_between_modules():
    known = modules()
    edges: dict[str, dict[str, str]] = {m: {} for m in known}
    for imp in imports(known):
        if imp.target != imp.source:
            edges[imp.source].setdefault(imp.target, imp.where)
    cycles: list[str] = []
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        # Depth first; a module met again on the current path closes a cycle.
        for nxt in sorted(edges[m]):
            if nxt in path:
                loop = [*path[path.index(nxt) :], nxt]
                cycles.append(
                    " -> ".join(f"{a} ({edges[a][b]})" for a, b in pairwise(loop)) + f" -> {nxt}"
                )
            elif nxt not in done:
                visit(nxt, [*path, nxt])
        done.add(m)

    for m in sorted(known):
        if m not in done:
            visit(m, [m])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_no_class_name_is_defined_twice():
    seen: dict[str, list[str]] = {}
    for path in modules().values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                seen.setdefault(node.name, []).append(f"{path.relative_to(ROOT)}:{node.lineno}")
    twice = {name: where for name, where in sorted(seen.items()) if len(where) > 1}
    assert not twice, "\n".join(f"class {n} defined at {', '.join(w)}" for n, w in twice.items())
