"""Why a small forward's timed ratio is above its instruction ratio: host code costs several times more right after a
forward (cold caches and predictors) than in a loop of itself. Times a few pieces of a replay context both ways on the
tiny model and prints warm µs, cold µs and their ratio.

    python benchmarks/host_cold.py   # about a minute

Warm: the piece alone, `timeit` in a loop (best of 7). Cold: the piece timed once right after a plain forward of the
model (B=1, T=32, no grad), median of 300. The pieces: one torch op that does nothing (`.cpu()` of a CPU tensor), a
replay context's construction, its enter and exit without a forward, and one replayed forward with its context
against a plain forward, paired within rounds (the difference is what moe-replay adds, cold by nature).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable

import torch
from run import TINY, build

from moe_replay import record_routes, replay_routes
from moe_replay.engines.hf.replay import RouteReplayer


def cold(piece: Callable[[], object], before: Callable[[], object], repeats: int) -> float:
    """Median seconds of `piece()` run right after `before()`."""
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        piece()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(TINY, "cpu")
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes = rec.routes

    def plain() -> None:
        with torch.no_grad():
            model(ids)

    def replayed() -> None:
        with torch.no_grad(), replay_routes(model, routes):
            model(ids)

    def enter_exit() -> None:  # no forward: the hub is detached directly (a context's exit checks its routes were used)
        ctx = RouteReplayer(model, routes)
        ctx.__enter__()
        ctx._hub.detach(ctx)
        ctx._hub = None

    pieces = {
        "one torch op (.cpu() of a CPU tensor)": lambda: routes.mask.cpu(),
        "replay context: construction": lambda: RouteReplayer(model, routes),
        "replay context: construction, enter, exit": enter_exit,
    }
    replayed()
    print("piece | warm us | cold us | cold / warm")
    for name, piece in pieces.items():
        warm = min(timeit.repeat(piece, number=200, repeat=7)) / 200
        after = cold(piece, plain, args.repeats)
        print(f"{name} | {warm * 1e6:.1f} | {after * 1e6:.1f} | {after / warm:.1f}", flush=True)
    ratios, base = [], []
    for r in range(args.repeats):  # paired: each round times both, in alternating order, after a plain forward
        times = {}
        for name, fn in (("plain", plain), ("ours", replayed))[:: 1 if r % 2 else -1]:
            times[name] = cold(fn, plain, 1)
        ratios.append(times["ours"] / times["plain"])
        base.append(times["plain"])
    print(f"replayed forward with its context / plain forward ({statistics.median(base) * 1e6:.0f} us): "
          f"{statistics.median(ratios):.3f} (median of paired ratios)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
