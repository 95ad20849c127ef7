"""megatron-core: `record_routes` / `replay_routes` against megatron-core's own `RouterReplay` driven by hand, through
its global API, as Megatron-based RL frameworks drive it (the peer), in CPU instructions (valgrind) and paired time.

    python benchmarks/megatron_native.py                  # instructions, both batch sizes (about 10 minutes)
    python benchmarks/megatron_native.py --timed          # paired time instead, with an A/A row (about 3 minutes)

The model is the Megatron tests' 2-layer GPT (hidden 64, 4 experts, top-2) on CPU with their shims. Works, each at
b = 32, s = 64 and b = 1, s = 32: recording a no-grad forward (ours: `with record_routes(model)`, `rec.routes`; the
peer: RECORD on every router, the forward, `get_recorded_data()` cloned), and replaying a forward and its backward
(ours: `with replay_routes(model, routes)`; the peer: `set_replay_data(rows)`, REPLAY_FORWARD, forward, backward,
`clear_global_indices()`). Instructions: each work in its own process under `valgrind --tool=callgrind
--instr-atstart=no`, the garbage collector off while counting, N repetitions after 3 uncounted ones, counted only
between the start and stop of a tiny C helper loaded with ctypes (imports, model build and warm-up uncounted; needs
`valgrind`, a C compiler and valgrind's `callgrind.h`: Debian `apt install valgrind gcc`). Writes
benchmarks/results_megatron_native.csv (--timed: ..._timed.csv; or --csv).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SIZES = {"b=32, s=64": (32, 64), "b=1, s=32": (1, 32)}
WORKS = {"record": ("record", "native_record"), "replay forward + backward": ("replay", "native_replay")}
REPS = {"b=32, s=64": 3, "b=1, s=32": 10}
HELPER = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""


def works(b: int, s: int) -> dict[str, Callable[[], None]]:
    """The four works on a fresh tiny GPT (inside megatron_cpu)."""
    import torch
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction
    from megatron_utils import batch, tiny_gpt

    from moe_replay.engines.megatron import record_routes, replay_routes, to_layer_rows

    RouterReplay.clear_global_router_replay_instances()  # (the global API drives every model built so far)
    model = tiny_gpt()
    tokens, pos, mask, labels = batch(b=b, s=s)
    with torch.no_grad(), record_routes(model) as rec:
        model(tokens, pos, mask)
    routes = rec.routes
    rows = to_layer_rows(routes)  # the peer's per-layer [s * b, K] int64 rows (sequence-major, as Megatron's)

    def record() -> None:
        with torch.no_grad(), record_routes(model) as r:
            model(tokens, pos, mask)
        r.routes  # noqa: B018 (the Routes, as a user reads them)

    def native_record() -> None:
        RouterReplay.set_global_router_replay_action(RouterReplayAction.RECORD)
        with torch.no_grad():
            model(tokens, pos, mask)
        [x.clone() for x in RouterReplay.get_recorded_data()]
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()

    def replay() -> None:
        with replay_routes(model, routes):
            model(tokens, pos, mask, labels=labels).mean().backward()

    def native_replay() -> None:
        RouterReplay.set_replay_data(list(rows))
        RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        model(tokens, pos, mask, labels=labels).mean().backward()
        RouterReplay.clear_global_router_replay_action()
        RouterReplay.clear_global_indices()

    return {"record": record, "native_record": native_record, "replay": replay, "native_replay": native_replay}


def session() -> object:
    """megatron_cpu from the Megatron tests (CPU shims, one gloo rank)."""
    sys.path[:0] = [str(ROOT / "tests" / "engines" / "megatron"), str(ROOT / "tests")]
    from helpers import free_port
    from megatron_utils import megatron_cpu

    return megatron_cpu(port=free_port())


def build_helper(where: Path) -> str:
    """Compile the callgrind start/stop helper into `where`; returns its path; a clear error if tools are missing."""
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


def child(size: str, work: str, reps: int, helper: str) -> None:
    """Under valgrind: `work` 3 times uncounted, then `reps` times counted, the garbage collector off while counting."""
    import torch

    torch.set_num_threads(1)
    with session():
        fn = works(*SIZES[size])[work]
        for _ in range(3):
            fn()
        lib = ctypes.CDLL(helper)
        gc.collect()
        gc.disable()
        lib.start()
        for _ in range(reps):
            fn()
        lib.stop()


def count(size: str, work: str, helper: str) -> float:
    """Instructions per repetition of `work`, from a fresh process under callgrind (one thread, this folder on the
    path, hash seed $PYTHONHASHSEED or 0: one seed repeats exactly)."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null", sys.executable,
           __file__, "--child", size, work, str(REPS[size]), helper]  # fmt: skip
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path,
           "PYTHONHASHSEED": os.environ.get("PYTHONHASHSEED", "0")}  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd[-5:])} failed:\n{out.stderr[-2000:]}")
    return int(found.group(1)) / REPS[size]


def timed(rounds: int) -> list[dict[str, object]]:
    """Paired rounds (ours right after the peer, then the peer against itself), median ratios."""
    import torch

    torch.set_num_threads(1)
    rows = []
    with session():
        for size, (b, s) in SIZES.items():
            fns = works(b, s)
            reps = REPS[size] * 3

            def clock(fn: Callable[[], None], n: int = reps) -> float:
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                return (time.perf_counter() - start) / n

            for name, (ours, peer) in {
                **WORKS,
                "A/A: the peer's replay against itself": ("native_replay",) * 2,
            }.items():
                for fn in (fns[ours], fns[peer]):
                    clock(fn, 3)
                pairs = [(clock(fns[peer]), clock(fns[ours])) for _ in range(rounds)]
                ratio = statistics.median(a / p for p, a in pairs)
                ms = statistics.median(a for _, a in pairs) * 1e3, statistics.median(p for p, _ in pairs) * 1e3
                rows.append({"work": f"{name}, {size}", "ours": round(ms[0], 3), "peer": round(ms[1], 3),
                             "unit": "ms", "ratio": round(ratio, 4)})  # fmt: skip
                print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    return rows


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5])
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--timed", action="store_true", help="paired time instead of instructions")
    ap.add_argument("--rounds", type=int, default=15, help="paired rounds per timed row")
    ap.add_argument("--csv", type=Path, help="default: results_megatron_native.csv (--timed: ..._timed.csv) here")
    args = ap.parse_args()
    name = "results_megatron_native_timed.csv" if args.timed else "results_megatron_native.csv"
    args.csv = args.csv or Path(__file__).with_name(name)
    sys.path.insert(0, str(Path(__file__).parent))
    from run import write_rows

    if args.timed:
        rows = timed(args.rounds)
    else:
        rows = []
        with tempfile.TemporaryDirectory() as tmp:
            helper = build_helper(Path(tmp))
            for size in SIZES:
                for name, (ours, peer) in WORKS.items():
                    a, p = count(size, ours, helper), count(size, peer, helper)
                    rows.append({"work": f"{name}, {size}", "ours": round(a / 1e6, 3), "peer": round(p / 1e6, 3),
                                 "unit": "M instructions", "ratio": round(a / p, 4)})  # fmt: skip
                    print(" | ".join(str(v) for v in rows[-1].values()), flush=True)
    write_rows(args.csv, rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
