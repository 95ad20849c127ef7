"""What recording and replay cost on the Hugging Face engine's two paths, against the same work without moe-replay:
declared router classes on their path (engines/hf/declared.py), and every router on the general path
(`MOE_REPLAY_PATH=general`), paired in one loop with an A/A row (two copies of the plain work).

    python benchmarks/host_cost.py           # benchmarks/results_host_cost.csv (about 15 minutes on 2 CPU cores)
    python benchmarks/host_cost.py --quick   # fewer rounds (about 4 minutes): results_host_cost_quick.csv
    python benchmarks/host_cost.py --only tiny   # the tiny rows alone (about 3 minutes), replaced in the CSV

The works (issue 62's table): a replayed forward + backward of B16 x 256 tokens on the realistic model (8 layers,
64 experts, top-8: benchmarks/run.py), recording under `generate` of B16 and 64 new tokens on it; on the tiny model
(4 layers, 16 experts, top-2), a replayed forward of B1 x 32 tokens without grad with its context opened and closed
around it (a log-prob chunk), the same with 10 forwards in one context (a cold context walks the model and sets its
hooks: its share), and recording under `generate` of B1 and 32 new tokens. Each round runs every variant
of a work once, in an order reversed every round, after a warm-up; a ratio is the median over rounds of variant /
plain within the round (this machine drifts between a fast and a slow state on a scale of seconds, which a ratio
within a round cancels). Times are the main thread's CPU time on one torch thread (`time.thread_time`). The targets
(issue 62): tiny rows at most 1.10 x plain on the declared path; realistic rows within the same run's A/A noise.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from run import REALISTIC, TINY, build, generate_fn, write_rows

from moe_replay import record_routes, replay_routes

TINY_TARGET = 1.10  # issue 62: tiny recording and replay at B = 1, declared path / plain
VARIANTS = ("plain", "plain (A/A)", "declared", "general")


def on_path(path: str | None, fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` run with MOE_REPLAY_PATH set to `path` (None: the plain work, no context)."""

    def run() -> object:
        if path is None:
            return fn()
        os.environ["MOE_REPLAY_PATH"] = path
        try:
            return fn()
        finally:
            del os.environ["MOE_REPLAY_PATH"]

    return run


def replay_work(
    model: torch.nn.Module, batch: int, length: int, grad: bool, per_context: int = 1
) -> dict[str, Callable[[], object]]:
    """`per_context` forwards of [batch, length] tokens (with a backward if `grad`), plain and replaying their own
    routes in one context."""
    ids = torch.randint(1, 1024, (batch, length), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes = rec.routes

    def forward() -> None:
        with torch.set_grad_enabled(grad):
            for _ in range(per_context):
                out = model(ids).logits
                if grad:
                    out.float().square().mean().backward()
                    model.zero_grad(set_to_none=True)

    def replayed() -> None:
        with replay_routes(model, routes):
            forward()

    return {"plain": forward, "plain (A/A)": forward, "declared": on_path("auto", replayed),
            "general": on_path("general", replayed)}  # fmt: skip


def record_work(model: torch.nn.Module, batch: int, new: int) -> dict[str, Callable[[], object]]:
    """`generate` of `new` tokens for [batch, 32] prompts, plain and recording."""
    plain, ours = generate_fn(model, batch, new, "cpu", False), generate_fn(model, batch, new, "cpu", True)
    return {"plain": plain, "plain (A/A)": plain, "declared": on_path("auto", ours),
            "general": on_path("general", ours)}  # fmt: skip


def rounds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, list[float]]:
    """CPU seconds of each variant in every round (order reversed every round, after one warm-up call each)."""
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in list(fns) if r % 2 else list(fns)[::-1]:
            t0 = time.thread_time()
            fns[name]()
            times[name].append(time.thread_time() - t0)
    return times


def paired_ratio(ours: list[float], plain: list[float]) -> float:
    """The median over rounds of ours / plain in the same round."""
    return statistics.median(a / b for a, b in zip(ours, plain, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a few minutes)")
    parser.add_argument("--only", default="", help="run only the works whose name starts with this, kept in the CSV")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.environ.pop("MOE_REPLAY_PATH", None)
    tiny, realistic = build(TINY, "cpu"), build(REALISTIC, "cpu")
    works = {  # name -> (model, variants, rounds (full, quick))
        "realistic replay, forward + backward (B16 x 256)": (realistic, replay_work(realistic, 16, 256, True), (9, 3)),
        "realistic recording under generate (B16, 64 new)": (realistic, record_work(realistic, 16, 64), (7, 3)),
        "tiny replay, a context per forward (B1 x 32)": (tiny, replay_work(tiny, 1, 32, False), (301, 61)),
        "tiny replay, 10 forwards per context (B1 x 32)": (tiny, replay_work(tiny, 1, 32, False, 10), (61, 15)),
        "tiny recording under generate (B1, 32 new)": (tiny, record_work(tiny, 1, 32), (41, 11)),
    }
    name = "results_host_cost_quick.csv" if args.quick else "results_host_cost.csv"
    path = Path(__file__).parent / name
    kept = {r["work"]: r for r in csv.DictReader(path.open())} if args.only and path.exists() else {}
    rows = []
    for name, (_, fns, (full, quick)) in works.items():
        if not name.startswith(args.only):
            if name in kept:
                rows.append(kept[name])
            continue
        times = rounds(fns, quick if args.quick else full)
        row = {"work": name, "plain_ms": round(1e3 * statistics.median(times["plain"]), 2)}
        for variant in VARIANTS[1:]:
            row[f"{variant} / plain"] = round(paired_ratio(times[variant], times["plain"]), 3)
        row["rounds"] = len(times["plain"])
        rows.append(row)
        print(row, flush=True)
    tiny_rows = [r for r in rows if r["work"].startswith("tiny")]
    met = sum(float(r["declared / plain"]) <= TINY_TARGET for r in tiny_rows)
    print(f"tiny rows at most {TINY_TARGET}x plain on the declared path: {met} of {len(tiny_rows)}")
    write_rows(path, rows)


if __name__ == "__main__":
    main()
