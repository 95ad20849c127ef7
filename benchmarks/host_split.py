"""Where recording's host time goes under `generate`: the tiny model's recording (B=1, 32 new tokens, as in
host_cost.py) timed in one loop with copies of it that each leave a part of moe-replay's work out.

    python benchmarks/host_split.py              # 300 rounds (about 4 minutes on 2 CPU cores)
    python benchmarks/host_split.py --rounds 100

Each variant swaps part of the work for less, in this process only, through the hub's kept patches and the
recorder's class (internals: this is a measuring probe, not an API). Only "as it is" records routes a user could
use. Variants, from the least work to the most:
  every wrapper a pass-through     the model's, the MoE blocks' and the routers' wrappers call what they wrap; the
                                   recorder's work skipped (left: the context, the generate wrapper)
  routers pass through             the step wrappers as they are, the routers' pass-throughs; recorder skipped
  minimal routers                  each router's wrapper only appends its output's indices (and their version) to
                                   the step; the recorder's work as it is (no checks: step, backward, repeated
                                   layer, training mode, the recording table)
  recorder skipped                 the code as it is, the recorder's work skipped (taking the steps, the masks of
                                   `generate`, building the routes)
  routes not built                 the code as it is, without building the routes at the end
  as it is, patched alike          the code as it is, its wrappers and the recorder's methods set again as they are
                                   through the same patching as the rows above (what the patching itself costs)
  as it is                         the code as it is
Every row prints its ratio to the plain generate (the paired median of host_cost.py: CPU time of the main thread,
one torch thread, paired within a round) and to "as it is", next to an A/A row of the plain work. The order is random
in every round (`host_cost.interleaved` with `shuffle`).
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from host_cost import interleaved, paired_ratio
from run import TINY, build, generate_fn

from moe_replay.engines.hf.layout import model_layout
from moe_replay.engines.hf.record import RouteRecorder


def pass_through(inner: Callable[..., Any]) -> Callable[..., Any]:
    """A wrapper that only calls `inner`, keeping `__wrapped__` (`generate` reads the signature: `logits_to_keep`)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        return inner(*args, **kwargs)

    forward.__wrapped__ = inner
    return forward


def appending(hub: Any, i: int, inner: Callable[..., Any]) -> Callable[..., Any]:
    """Router `i`'s wrapper reduced to appending its output's top-k indices to the running step (as the recording
    table's path does, without its checks)."""
    name, logits_index = hub.sites[i].name, hub.sites[i].logits_index
    j = hub.facts[i].output_index[False]

    def forward(*args: Any, **kwargs: Any) -> Any:
        out = inner(*args, **kwargs)
        indices = out[j]
        hub.taken.append((name, indices, indices._version, out[logits_index].shape[-1]))
        return out

    return forward


@contextmanager
def swapped(hub: Any, make: Callable[[Any, Callable[..., Any]], Callable[..., Any] | None]) -> Iterator[None]:
    """The hub's kept patches, each wrapper replaced by `make(entry, what it wraps)` (None: kept) while open."""
    saved = []
    for e in hub._patches._undone:  # (what the next context sets again: the patches of the last one)
        wrapped = getattr(e.value, "__wrapped__", None)
        new = None if wrapped is None or e.attr != "forward" else make(e, wrapped)
        if new is not None:
            saved.append((e, e.value))
            e.value = new
    if not saved:
        raise RuntimeError("no kept wrapper to swap: the hub's patches are not what this probe expects")
    try:
        yield
    finally:
        for e, value in saved:
            e.value = value


@contextmanager
def recorder_without(*names: str, alike: bool = False) -> Iterator[None]:
    """`RouteRecorder`'s methods `names` as no-ops (and `routes` as None) while open (`alike`: set again as they are,
    the control of what this patching costs)."""
    saved = {n: RouteRecorder.__dict__[n] for n in names}
    for n in names:
        if alike:
            setattr(RouteRecorder, n, saved[n])
        else:
            setattr(RouteRecorder, n, property(lambda self: None) if n == "routes" else (lambda self, *a: None))
    try:
        yield
    finally:
        for n, value in saved.items():
            setattr(RouteRecorder, n, value)


def variants(hub: Any) -> dict[str, Callable[[], AbstractContextManager]]:
    """Each variant's patching, as a context manager factory (see the module's docstring)."""
    routers = {id(s.router): i for i, s in enumerate(hub.sites)}
    skip = ("routes", "record_step", "on_generate")

    def every(e: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
        return pass_through(inner)

    def routers_only(e: Any, inner: Callable[..., Any]) -> Callable[..., Any] | None:
        return pass_through(inner) if id(e.module) in routers else None

    def minimal(e: Any, inner: Callable[..., Any]) -> Callable[..., Any] | None:
        i = routers.get(id(e.module))
        return None if i is None else appending(hub, i, inner)

    def alike(e: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
        return e.value

    @contextmanager
    def both(make: Callable[..., Any], *names: str, alike: bool = False) -> Iterator[None]:
        with swapped(hub, make), recorder_without(*names, alike=alike):
            yield

    return {
        "every wrapper a pass-through": lambda: both(every, *skip),
        "routers pass through": lambda: both(routers_only, *skip),
        "minimal routers": lambda: both(minimal),
        "recorder skipped": lambda: recorder_without(*skip),
        "routes not built": lambda: recorder_without("routes"),
        "as it is, patched alike": lambda: both(alike, *skip, alike=True),
        "as it is": nullcontext,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = build(TINY, "cpu")
    record, plain = generate_fn(model, 1, 32, "cpu", True), generate_fn(model, 1, 32, "cpu", False)
    record()  # a first context learns the routers' classes; the hub and its patches are then kept on the model
    hub = model_layout(model).kept["hub"]
    if not all(f.output_index.get(False) is not None for f in hub.facts):
        raise SystemExit("the tiny model's routers are not read from their output: this split does not apply")

    def under(patching: Callable[[], AbstractContextManager]) -> Callable[[], object]:
        def run() -> object:
            with patching():
                return record()

        return run

    fns: dict[str, Callable[[], object]] = {name: under(p) for name, p in variants(hub).items()}
    a, b = fns["minimal routers"](), record()  # the minimal routers' routes are the code's own (on this model)
    if not (torch.equal(a.indices, b.indices) and torch.equal(a.mask, b.mask) and a.layers == b.layers):
        raise SystemExit("the minimal routers recorded other routes than the code as it is: not a like-for-like split")
    fns.update(plain=plain, plain2=plain)
    times = interleaved(fns, args.rounds, shuffle=random.Random(0))
    print(f"tiny model, recording under generate of 32 new tokens, B=1; {args.rounds} rounds")
    print("work | ratio to plain | ratio to 'as it is'")
    for name in fns:
        if name == "plain":
            continue
        label = "A/A (plain)" if name == "plain2" else name
        to_plain = paired_ratio(times[name], times["plain"])
        print(f"{label} | {to_plain:.4f} | {paired_ratio(times[name], times['as it is']):.4f}")
    print(f"plain generate: {statistics.median(times['plain']) * 1e3:.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
