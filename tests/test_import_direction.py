"""Imports inside the package point one way (DESIGN.md §6, docs/README.md): routes ← engines ← analysis / rl ←
integrations ← cli. A module may import from its own part or a part to its left, never from one to its right."""

from __future__ import annotations

import ast
from pathlib import Path

import moe_replay

PACKAGE = Path(moe_replay.__file__).parent
# the rank of each top-level part; modules directly in the package (routes*, errors, layers, tiny) are rank 0
RANK = {"engines": 1, "analysis": 2, "rl": 2, "integrations": 3, "cli": 4}
EXEMPT = {"__init__"}  # the package's own namespace re-exports from every part


def part_of(dotted: str) -> str:
    """The top-level part of `moe_replay.<part>...` (a module directly in the package is its own part)."""
    return dotted.split(".")[1] if "." in dotted else ""


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every moe_replay import in `path`, relative ones resolved."""
    parts = ("moe_replay", *path.relative_to(PACKAGE).with_suffix("").parts)
    package = ".".join(parts[:-1])  # what a relative import starts from (an __init__'s own package)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            # `from . import x`: each name is a module of that package
            names = [target] if node.module else [f"{target}.{a.name}" for a in node.names]
            found += [(node.lineno, n) for n in names]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
    return [(line, name) for line, name in found if name == "moe_replay" or name.startswith("moe_replay.")]


def test_no_module_imports_from_a_part_to_its_right() -> None:
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if len(rel.parts) == 1 and rel.stem in EXEMPT:
            continue
        own = RANK.get(rel.parts[0].removesuffix(".py"), 0)
        for line, name in imported_modules(path):
            target = part_of(name)
            if RANK.get(target, 0) > own:
                wrong.append(f"{rel}:{line} imports {name} (rank {RANK.get(target, 0)} > {own})")
    assert not wrong, "imports against the direction routes ← engines ← analysis / rl ← integrations ← cli:\n" + (
        "\n".join(wrong)
    )


def test_the_check_sees_relative_imports() -> None:
    # rl/policy.py imports ..tiny, and trl/trainer.py imports ...engines: both must resolve, or the test above is blind
    names = {n for _, n in imported_modules(PACKAGE / "rl" / "policy.py")}
    assert "moe_replay.tiny" in names
    names = {n for _, n in imported_modules(PACKAGE / "integrations" / "trl" / "trainer.py")}
    assert "moe_replay.engines" in names and "moe_replay.routes" in names
    names = {n for _, n in imported_modules(PACKAGE / "engines" / "__init__.py")}
    assert {"moe_replay.engines.hf", "moe_replay.engines.megatron", "moe_replay.routes"} <= names


def test_no_import_cycles_in_the_engines() -> None:
    """No module of engines/ reaches itself through imports (including imports inside functions and for type
    checking only): each engine's files read in one order."""
    modules = {
        "moe_replay." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__"): p
        for p in sorted((PACKAGE / "engines").rglob("*.py"))
    }
    graph = {m: {n for _, n in imported_modules(p) if n in modules and n != m} for m, p in modules.items()}

    def reaches(start: str) -> list[str] | None:
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(graph[node]):
                if nxt == start:
                    return [*path, start]
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
        return None

    cycles = {" -> ".join(c) for m in graph if not m.endswith(("hf", "megatron", "engines")) and (c := reaches(m))}
    assert not cycles, "import cycles:\n" + "\n".join(sorted(cycles))
