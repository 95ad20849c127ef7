"""How many Python function calls, and which torch functions, recording and replay add to a small forward: a count
that takes seconds, is the same in every run, and names the functions (callgrind's instruction counts take minutes
and name C functions only).

    python benchmarks/host_calls.py              # the tiny model, the three works of host_cost.py
    python benchmarks/host_calls.py --top 20     # and the 20 functions that add the most calls to each work

Counts Python-level calls and calls of C functions (`sys.setprofile`) during one repetition of each work, after
warm-up, against the same work without moe-replay (B=1, T=32, no grad): a replayed forward with its context, 10
replayed forwards in one context, recording under `generate` of 32 new tokens. Torch functions are counted with a
`TorchFunctionMode` (tensor methods and properties included). Prints one line per work: the extra calls, per
repetition and per router call.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Callable

import torch
from host_cost import HELD, replay_forward
from run import TINY, generate_fn
from torch.overrides import TorchFunctionMode


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions called while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.seen[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def python_calls(fn: Callable[[], object]) -> Counter[str]:
    """Calls made while `fn()` runs, by 'file:function' (C functions as 'file:C:name', file being the caller's)."""
    seen: Counter[str] = Counter()

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call":
            seen[f"{frame.f_code.co_filename.rpartition('/')[2]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            seen[f"{frame.f_code.co_filename.rpartition('/')[2]}:C:{getattr(arg, '__qualname__', arg)}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--top", type=int, default=0, help="also list the N functions that add the most calls")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, ours, held, plain, plain_held = replay_forward(TINY, batch=1, length=32)  # host_cost.py's works
    L = model.config.num_hidden_layers
    works = {  # name: (ours, plain, router calls per repetition)
        "replay forward": (ours, plain, L),
        f"replay forward, {HELD} per context": (held, plain_held, HELD * L),
        "record generate": (generate_fn(model, 1, 32, "cpu", True), generate_fn(model, 1, 32, "cpu", False), 32 * L),
    }
    print(
        "work (tiny, B=1) | calls (Python and C): ours / plain | extra per router call | torch functions: ours / plain"
    )
    for name, (mine, without, calls) in works.items():
        for fn in (mine, without, mine, without):  # warm-up: the first contexts learn the router class's facts
            fn()
        counted = {}
        for label, fn in (("ours", mine), ("plain", without)):
            with TorchCalls() as mode:
                fn()
            counted[label] = (python_calls(fn), mode.seen)
        (py_ours, t_ours), (py_plain, t_plain) = counted["ours"], counted["plain"]
        n_ours, n_plain = sum(py_ours.values()), sum(py_plain.values())
        print(f"{name} | {n_ours} / {n_plain} | {(n_ours - n_plain) / calls:.1f} | "
              f"{sum(t_ours.values())} / {sum(t_plain.values())}")  # fmt: skip
        if args.top:
            for where, n in ((py_ours - py_plain) + Counter()).most_common(args.top):
                print(f"    +{n} {where}")
            print(f"    torch functions added: {dict(t_ours - t_plain)}, removed: {dict(t_plain - t_ours)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
