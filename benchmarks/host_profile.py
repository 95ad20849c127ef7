"""Where moe-replay's host time goes in a small forward or generate: samples the tiny model's work with py-spy and
prints the share of moe-replay's own samples by the function that spent them.

    pip install py-spy                               # not a project dependency; it needs ptrace (root in a container)
    python benchmarks/host_profile.py                # a replayed forward with its context, 60 s of sampling
    python benchmarks/host_profile.py --work record  # recording under generate
    python benchmarks/host_profile.py --work held    # 10 replayed forwards per context

A loop alternates the plain work and the same work under moe-replay; py-spy samples it (1 kHz, without stopping the
process). A sample is moe-replay's own when it falls inside the moe-replay work and no model code runs below its
innermost moe-replay frame (torch ops that moe-replay itself calls count as its own; the router's forward, run from
moe-replay's wrapper, does not). Each is charged to the outermost moe-replay function below the model code that
called it: a router call's wrapper, a step's wrapper, the context's enter or exit (`--innermost`: to the function
running, e.g. the span conversion or the layout check). Sampling slows the process
unevenly, so the ratio it prints is not host_cost.py's timed ratio: read the shares, not the totals.
"""

from __future__ import annotations

import argparse
import collections
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODEL_CODE = ("transformers/", "torch/nn/modules")  # frames of the model's own work


def loop(work: str, seconds: float) -> None:
    """Alternate the plain work (`plain`) and the same under moe-replay (`ours`) for `seconds`."""
    import torch
    from run import TINY, build, generate_fn

    from moe_replay import record_routes, replay_routes

    torch.set_num_threads(1)
    model = build(TINY, "cpu")
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes, n = rec.routes, 10 if work == "held" else 1
    record, generate = generate_fn(model, 1, 32, "cpu", True), generate_fn(model, 1, 32, "cpu", False)

    def plain() -> None:
        if work == "record":
            generate()
            return
        with torch.no_grad():
            for _ in range(n):
                model(ids)

    def ours() -> None:
        if work == "record":
            record()
            return
        with torch.no_grad(), replay_routes(model, routes):
            for _ in range(n):
                model(ids)

    end = time.time() + seconds
    while time.time() < end:
        plain()
        ours()


def shares(raw: Path, innermost: bool = False) -> tuple[collections.Counter, collections.Counter]:
    """(samples of `plain` and `ours`, moe-replay's own samples by charged function) from py-spy's raw output; with
    `innermost`, each is charged to the innermost moe-replay function instead (the one running, or calling torch)."""
    totals: collections.Counter = collections.Counter()
    own: collections.Counter = collections.Counter()
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():  # a line without a count (py-spy cuts its last off as the process ends)
            continue
        frames, n = stack.split(";"), int(count)
        names = {f.partition(" (")[0].rpartition(".")[2] for f in frames}  # (`loop.<locals>.ours` -> `ours`)
        kind = "ours" if "ours" in names else "plain" if "plain" in names else None
        if kind is None:
            continue
        totals[kind] += n
        ours_at = [i for i, f in enumerate(frames) if "moe_replay" in f]
        if kind != "ours" or not ours_at or any(c in f for f in frames[ours_at[-1] + 1 :] for c in MODEL_CODE):
            continue
        last_model = max((i for i, f in enumerate(frames) if any(c in f for c in MODEL_CODE)), default=-1)
        outermost = next(frames[i] for i in ours_at if i > last_model)  # (the innermost one is past the model code)
        charged = frames[ours_at[-1]] if innermost else outermost
        own[re.sub(r" \(.*", "", charged)] += n
    return totals, own


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", choices=["replay", "held", "record"], default="replay")
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--top", type=int, default=15, help="functions shown")
    ap.add_argument("--innermost", action="store_true", help="charge each sample to the innermost function")
    ap.add_argument("--_loop", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._loop:
        loop(args.work, args.seconds)
        return 0
    spy = shutil.which("py-spy")
    if spy is None:
        print("needs py-spy: pip install py-spy", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "samples.txt"
        child = [sys.executable, __file__, "--_loop", "--work", args.work, "--seconds", str(args.seconds)]
        cmd = [spy, "record", "-f", "raw", "-r", "997", "--nonblocking", "-o", str(raw), "--", *child]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).parent)
        totals, own = shares(raw, args.innermost) if raw.exists() else (collections.Counter(), collections.Counter())
    if done.returncode != 0 or not totals["ours"] or not totals["plain"]:  # (py-spy exits 0 when the loop failed)
        print(f"py-spy sampled no work (exit {done.returncode}):\n{done.stdout}{done.stderr}", file=sys.stderr)
        return 1
    mine = sum(own.values())
    print(f"samples: plain {totals['plain']}, ours {totals['ours']}, moe-replay's own {mine}")
    print("function (moe-replay's own samples charged to it) | samples | share of own")
    for name, n in own.most_common(args.top):
        print(f"{name} | {n} | {n / max(mine, 1):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
