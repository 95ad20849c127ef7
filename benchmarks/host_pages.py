"""Why the tiny recording row moves from run to run: on this machine, memory left untouched for a while costs far more
to touch again than a cache miss, by an amount that grows with how long it sat idle; moe-replay's objects sit idle
between a loop's generates, and the row's ratio moves with the loop.

    python benchmarks/host_pages.py            # about 10 minutes: every part, with the default heap and on huge pages
    python benchmarks/host_pages.py --rounds 30 --no-huge

1. **No moe-replay.** A loop touches N small Python objects (a dict and a list each, with 5 MB allocated after them)
   right after the thread spins for a while without touching memory (1 ms to 500 ms); main-thread CPU time, median
   over repetitions. A cache miss costs about 0.1 µs; what a touch costs beyond that is the machine's.
2. **The recording row** of host_cost.py (the tiny model, B=1, 32 new tokens under `generate`, the routes built), as
   host_cost.py measures it (paired ratios within a round, random order), with 1, 2 (host_cost.py's loop: two plain
   copies) or 5 plain generates in each round: the more work between two recorded generates, the longer moe-replay's
   objects sit idle. Then back to back: blocks of 4 recorded generates, 4 plain ones and 4 more plain ones (the A/A),
   in an order reversed every round, the first of each block dropped (the others' objects last ran in the block).
3. **Code or data.** A recording context's construction and enter (with its exit, untimed) after the thread spun
   for 160 ms: on one tiny model (moe-replay's code and that model's hub idle), right after on a second tiny model
   (its hub idle, the code just ran), and once more on the second (warm).

Every part runs again in a child process whose heap is on transparent huge pages (`PYTHONMALLOC=malloc` with glibc's
`glibc.malloc.hugetlb=1`): one page table entry per 2 MiB instead of per 4 KiB. Writes
benchmarks/results_host_pages.csv (or --csv).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HUGE = {"PYTHONMALLOC": "malloc", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}
IDLE = (0.001, 0.01, 0.05, 0.16, 0.5)  # seconds spun before a touch
OBJECTS = 2000


def spin(seconds: float) -> None:
    """Keep the thread busy for `seconds` without touching memory beyond a few locals."""
    t0, x = time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        x += 1


def idle_touch(repeats: int) -> dict[float, float]:
    """Median µs to touch `OBJECTS` objects after spinning each time in `IDLE` (no moe-replay)."""
    objects = [{"a": i, "b": [i, i + 1]} for i in range(OBJECTS)]
    spread = [bytearray(200) for _ in range(OBJECTS * 10)]  # other allocations after them (about 5 MB)

    def touch() -> int:
        total = 0
        for o in objects:
            total += o["a"] + o["b"][0]
        return total

    times: dict[float, list[float]] = {s: [] for s in IDLE}
    for _ in range(repeats):
        for seconds in IDLE:
            spin(seconds)
            t0 = time.thread_time()
            touch()
            times[seconds].append(time.thread_time() - t0)
    del spread
    return {s: statistics.median(t) * 1e6 for s, t in times.items()}


def recording_row(rounds: int) -> dict[str, tuple[float, float | None]]:
    """(ratio, A/A) of the tiny recording row with 1, 2 and 5 plain generates per round, and back to back."""
    import torch
    from host_cost import interleaved, paired_ratio
    from run import TINY, build, generate_fn

    torch.set_num_threads(1)
    model = build(TINY, "cpu")
    ours, plain = generate_fn(model, 1, 32, "cpu", True), generate_fn(model, 1, 32, "cpu", False)
    rows: dict[str, tuple[float, float | None]] = {}
    for k in (1, 2, 5):
        t = interleaved({"ours": ours, **{f"plain{i}": plain for i in range(k)}}, rounds, random.Random(0))
        aa = paired_ratio(t["plain1"], t["plain0"]) if k > 1 else None
        rows[f"interleaved, {k} plain per round"] = (paired_ratio(t["ours"], t["plain0"]), aa)
        print(f"  {k} plain per round: {rows[f'interleaved, {k} plain per round'][0]:.4f}", flush=True)
    ratios, aa = [], []
    for b in range(max(2, rounds // 2)):
        block: dict[str, float] = {}
        order = [("ours", ours), ("plain", plain), ("plain2", plain)]
        for name, fn in order if b % 2 else order[::-1]:
            times = []
            for _ in range(4):
                t0 = time.thread_time()
                fn()
                times.append(time.thread_time() - t0)
            block[name] = statistics.median(times[1:])
        ratios.append(block["ours"] / block["plain"])
        aa.append(block["plain2"] / block["plain"])
    rows["back to back, blocks of 4"] = (statistics.median(ratios), statistics.median(aa))
    print(f"  back to back: {rows['back to back, blocks of 4'][0]:.4f}", flush=True)
    return rows


def code_or_data(repeats: int) -> dict[str, float]:
    """Median µs of a recording context's construction and enter after 160 ms of spinning: first on one model, then
    on another (only its hub idle), then on that one again (warm)."""
    import torch
    from run import TINY, build

    from moe_replay import record_routes

    models = [build(TINY, "cpu"), build(TINY, "cpu")]
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))

    def enter(model: torch.nn.Module) -> float:
        t0 = time.thread_time()
        context = record_routes(model)
        context.__enter__()
        took = time.thread_time() - t0
        context.__exit__(None, None, None)
        return took

    for model in models * 2:  # each model's hub made, its facts learned
        with torch.no_grad(), record_routes(model):
            model(ids)
    names = ("first model: code and hub idle", "second model: its hub idle", "second model again: warm")
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(repeats):
        spin(0.16)
        first, second = models if r % 2 else models[::-1]
        for name, model in zip(names, (first, second, second), strict=True):
            times[name].append(enter(model))
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def measure(rounds: int, heap: str) -> list[dict]:
    """Every part in this process, as CSV rows."""
    print(f"heap: {heap}", flush=True)
    out = []
    for seconds, us in idle_touch(max(3, rounds // 5)).items():
        name = f"touch {OBJECTS} objects after {seconds * 1e3:g} ms idle, us"
        out.append({"heap": heap, "measure": name, "value": round(us, 1), "aa": ""})
        print(f"  touch {OBJECTS} objects after {seconds * 1e3:g} ms idle: {us:.1f} us", flush=True)
    for name, (ratio, aa) in recording_row(rounds).items():
        aa_cell = "" if aa is None else round(aa, 4)
        out.append({"heap": heap, "measure": f"tiny recording row, {name}", "value": round(ratio, 4), "aa": aa_cell})
    for name, us in code_or_data(max(10, rounds // 2)).items():
        out.append(
            {
                "heap": heap,
                "measure": f"recording context's enter after 160 ms idle, {name}, us",
                "value": round(us, 1),
                "aa": "",
            }
        )
        print(f"  enter after 160 ms idle, {name}: {us:.1f} us", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--no-huge", action="store_true", help="skip the run with the heap on huge pages")
    ap.add_argument("--csv", type=Path, default=Path(__file__).with_name("results_host_pages.csv"))
    ap.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:  # the huge-page run: its rows as JSON on stdout's last line
        print(json.dumps(measure(args.rounds, "huge pages")))
        return 0
    rows = measure(args.rounds, "default")
    if not args.no_huge:
        cmd = [sys.executable, __file__, "--rounds", str(args.rounds), "--_child"]
        from run import child_stdout

        lines = child_stdout(cmd, env={**os.environ, **HUGE}).strip().splitlines()
        print("\n".join(lines[:-1]))
        rows += json.loads(lines[-1])
    from run import write_rows

    write_rows(args.csv, rows)
    print(f"wrote {args.csv}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
