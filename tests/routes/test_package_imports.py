"""`moe_replay.routes` is the bottom of the package (DESIGN.md §6): its modules import nothing of moe_replay but each
other and `errors` (no engine, integration, analysis or rl), and each keeps to one job of at most ~300 lines."""

from __future__ import annotations

from pathlib import Path

from test_import_direction import imported_modules

import moe_replay.routes

ROUTES = Path(moe_replay.routes.__file__).parent


def test_routes_imports_only_itself_and_errors() -> None:
    wrong = [
        f"routes/{path.name}:{line} imports {name}"
        for path in sorted(ROUTES.glob("*.py"))
        for line, name in imported_modules(path)
        if not (name.startswith("moe_replay.routes.") or name in ("moe_replay.routes", "moe_replay.errors"))
    ]
    assert not wrong, "moe_replay.routes imports from above it:\n" + "\n".join(wrong)


def test_routes_modules_stay_small() -> None:
    sizes = {path.name: len(path.read_text().splitlines()) for path in ROUTES.glob("*.py")}
    assert max(sizes.values()) <= 300, sizes
