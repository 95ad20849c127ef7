"""The training loop's CSV logs (steps.csv, minibatches.csv): rows appended as a run goes, cut back to a checkpoint
when it resumes. A column that appears later (a metric first logged at a later step, or a resumed run that logs more)
widens the whole file, so that every row stays under its own header and nothing written before is lost."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any


def append_rows(path: Path, rows: list[dict[str, Any]]) -> None:
    """Append `rows` to the CSV log at `path` (made with a header if missing). A row's missing columns are left
    empty; a column the file lacks is added to its header, and the rows before it get it empty.

    Example:
        >>> append_rows(Path("run/steps.csv"), [{"step": 0, "reward": 0.5}])  # doctest: +SKIP
    """
    if not rows:
        return
    columns = list(dict.fromkeys(key for row in rows for key in row))
    old: list[dict[str, str]] = []
    header: list[str] = []
    if path.exists():
        with path.open(newline="") as f:
            reader = csv.DictReader(f)
            header = list(reader.fieldnames or [])
            if any(c not in header for c in columns):
                old = list(reader)  # (read only when the header must widen)
    widened = header + [c for c in columns if c not in header]
    if header and widened == header:
        with path.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=header, restval="").writerows(rows)
        return
    _write(path, widened, old + rows)


def truncate_rows(path: Path, step: int) -> None:
    """Drop the log rows written after `step` (a resumed run writes them again)."""
    if not path.exists():
        return
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header, rows = list(reader.fieldnames or []), list(reader)
    if header:
        _write(path, header, [r for r in rows if int(r["step"]) <= step])


def _write(path: Path, header: list[str], rows: list[dict[str, Any]]) -> None:
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=header, restval="")
        writer.writeheader()
        writer.writerows(rows)
