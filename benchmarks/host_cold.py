"""Why a small forward's timed ratio is above its instruction ratio: host code costs several times more right after a
forward (cold caches and predictors) than in a loop of itself. Times a few pieces of a replay context both ways on the
tiny model and prints warm µs, cold µs and their ratio.

    python benchmarks/host_cold.py   # about a minute

Warm: the piece alone, `timeit` in a loop (best of 7). Cold: the piece timed once right after a plain forward of the
model (B=1, T=32, no grad), median of 300. The pieces: one torch op that does nothing (`.cpu()` of a CPU tensor), a
replay context's construction, its enter and exit without a forward, and one replayed forward with its context
against a plain forward, paired within rounds (the difference is what moe-replay adds, cold by nature). Then the
parts of one replayed forward with its context, each timed inside it (see `inside_a_replayed_forward`).
"""

from __future__ import annotations

import argparse
import statistics
import time
import timeit
from collections.abc import Callable

import torch
from run import TINY, build

from moe_replay import Routes, find_routers, record_routes, replay_routes
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


def inside_a_replayed_forward(model: torch.nn.Module, ids: torch.Tensor, routes: Routes, repeats: int) -> dict:
    """Median µs (main-thread CPU time) of each part of one replayed forward with its context, each forward run right
    after a plain one: the context's enter and exit, the span's conversion (at its first router call), the replayer's
    plan lookups, the router calls in the lane (the router's own forward included) and the whole forward (inside the
    model's own hooks, so with the step tracking), next to the same in the plain forward. Timed by wrapping each
    part (the wrappers add their own small cost)."""
    gates = [s.router for s in find_routers(model)]
    spent: dict[str, int] = {}

    def timing(owner: object, name: str, label: str) -> Callable[[], None]:
        inner = getattr(owner, name)

        def wrapper(*args: object, **kwargs: object) -> object:
            t0 = time.thread_time_ns()
            try:
                return inner(*args, **kwargs)
            finally:
                spent[label] = spent.get(label, 0) + time.thread_time_ns() - t0

        setattr(owner, name, wrapper)
        return lambda: setattr(owner, name, inner)

    def gate_start(module: torch.nn.Module, args: tuple) -> None:
        spent["t0"] = time.thread_time_ns()

    def gate_end(module: torch.nn.Module, args: tuple, out: object) -> None:
        label = "router calls, replayed" if spent.get("replaying") else "router calls, plain"
        spent[label] = spent.get(label, 0) + time.thread_time_ns() - spent.pop("t0")

    undo = [
        timing(RouteReplayer, "__enter__", "context enter"),
        timing(RouteReplayer, "__exit__", "context exit"),
        timing(RouteReplayer, "_step_span", "span conversion"),
        timing(RouteReplayer, "plan", "plan lookups (with the conversion)"),
    ]

    def model_start(module: torch.nn.Module, args: tuple) -> None:
        spent["m0"] = time.thread_time_ns()

    def model_end(module: torch.nn.Module, args: tuple, out: object) -> None:
        label = "whole forward, replayed" if spent.get("replaying") else "whole forward, plain"
        spent[label] = time.thread_time_ns() - spent.pop("m0")

    hooks = [h for g in gates for h in (g.register_forward_pre_hook(gate_start), g.register_forward_hook(gate_end))]
    hooks += [model.register_forward_pre_hook(model_start), model.register_forward_hook(model_end)]
    found: dict[str, list[int]] = {}
    try:
        for _ in range(repeats):
            with torch.no_grad():
                model(ids)
            spent.clear()
            with torch.no_grad():
                model(ids)
            spent["replaying"] = 1
            with torch.no_grad(), replay_routes(model, routes):
                model(ids)
            for label, ns in spent.items():
                if label != "replaying":
                    found.setdefault(label, []).append(ns)
    finally:
        for h in hooks:
            h.remove()
        for restore in undo:
            restore()
    return {label: statistics.median(ns) / 1e3 for label, ns in found.items()}


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
    print(f"inside one replayed forward with its context, {len(find_routers(model))} router calls (cold, median us):")
    for label, us in inside_a_replayed_forward(model, ids, routes, args.repeats).items():
        print(f"  {label}: {us:.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
