"""Counting CPU instructions under valgrind's callgrind, shared by host_cost.py --count and megatron_native.py.

A script under test runs as a fresh process under `valgrind --tool=callgrind --instr-atstart=no`: its imports, model
build and warm-up run uninstrumented, and counting runs only between the start and stop of a tiny C helper (built by
`build_helper`, loaded with ctypes in the child), so the count covers the measured repetitions alone. Needs
`valgrind`, a C compiler and valgrind's `callgrind.h` (Debian: `apt install valgrind gcc`).

Example (the parent builds the helper and starts the child; the child, this script again, counts `fn`):
    >>> helper = build_helper(Path(tmp))  # doctest: +SKIP
    >>> per_repetition = counted(__file__, ["--child", work, str(reps), helper], reps)  # doctest: +SKIP
    >>> run_counted(fn, reps, helper)  # in the child  # doctest: +SKIP

Two works compared (ours against plain) are best counted in one process, in turn (`counted_together`, `run_together`):
a count moves by ~0.5% between processes with the memory layout (the hash seed, the paths, the environment), as much
as moe-replay adds to a forward; in one process both works see the same layout, and their difference repeats to a few
hundredths of a percent of the work.
"""

from __future__ import annotations

import ctypes
import gc
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HELPER = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def counted(script: str, args: list[str], reps: int, seed: int | None = None) -> float:
    """Instructions per repetition that `python script *args` counts between the helper's start and stop, run under
    callgrind in a fresh process (one thread, this folder on the path, hash seed `seed`: default $PYTHONHASHSEED or
    0). One seed repeats exactly; across seeds and code layouts a row shifts by ~0.5%."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null", sys.executable,
           script, *args]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=_environment(seed), check=False)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd[-4:])} failed:\n{out.stderr[-2000:]}")
    return int(found.group(1)) / reps


def counted_together(script: str, args: list[str], works: list[str], reps: int, seed: int | None = None) -> dict:
    """Instructions of each of `works` per repetition, a list of `reps` counts each, counted in one fresh process
    under callgrind: `python script *args` runs them in turn (`run_together`), each repetition of each work dumped on
    its own. Same environment as `counted`."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "counts"
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}", "--dump-instr=no",
               sys.executable, script, *args]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, env=_environment(seed), check=False)
        dumps = sorted(Path(tmp).glob("counts.*"), key=lambda p: int(p.suffix[1:]))
        if done.returncode != 0 or len(dumps) != reps * len(works):
            raise RuntimeError(f"{' '.join(cmd[-4:])} failed ({len(dumps)} dumps):\n{done.stderr[-2000:]}")
        totals = [int(re.search(r"^totals: (\d+)", d.read_text(), re.M).group(1)) for d in dumps]
    found: dict[str, list[int]] = {work: [] for work in works}
    for work, total in zip(together_order(works, reps), totals, strict=True):
        found[work].append(total)
    return found


def together_order(works: list, reps: int) -> list:
    """The order `run_together` counts `works` in: in turn, reversed every other repetition (a work run right after
    another is not favoured)."""
    return [w for r in range(reps) for w in (works if r % 2 == 0 else works[::-1])]


def run_together(fns: list[Callable[[], object]], reps: int, helper: str, collect: bool = False) -> None:
    """In the child under valgrind: each of `fns` three times uncounted, then `reps` rounds of each counted on its own
    (`together_order`); `collect` as for `run_counted`."""
    lib = _warmed(fns, helper, collect)
    for fn in together_order(fns, reps):
        lib.start()
        fn()
        lib.stop()


def _warmed(fns: list[Callable[[], object]], helper: str, collect: bool) -> ctypes.CDLL:
    """Run each of `fns` three times uncounted and load the helper; with `collect` False the garbage collector is
    run, then turned off while counting."""
    for fn in fns:
        for _ in range(3):
            fn()
    lib = ctypes.CDLL(helper)
    if not collect:
        gc.collect()
        gc.disable()
    return lib


def _environment(seed: int | None) -> dict[str, str]:
    """The child's environment: one thread, this folder on the path, hash seed `seed` (default $PYTHONHASHSEED or 0)."""
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    seed = os.environ.get("PYTHONHASHSEED", "0") if seed is None else seed
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path, "PYTHONHASHSEED": str(seed)}


def build_helper(where: Path) -> str:
    """Compile the start/stop helper into `where`; returns its path. A clear error if the tools are missing."""
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"counting instructions needs {missing} on PATH (Debian: apt install valgrind gcc)")
    (where / "helper.c").write_text(HELPER)
    lib = where / "helper.so"
    made = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(where / "helper.c")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if made.returncode != 0:
        raise SystemExit(f"could not build the callgrind helper (is valgrind's callgrind.h installed?):\n{made.stderr}")
    return str(lib)


def run_counted(fn: Callable[[], object], reps: int, helper: str, collect: bool = False) -> None:
    """In the child under valgrind: `fn` three times uncounted, then `reps` times counted; with `collect` False the
    garbage collector is run, then turned off while counting (counts that repeat exactly)."""
    lib = _warmed([fn], helper, collect)
    lib.start()
    for _ in range(reps):
        fn()
    lib.stop()
