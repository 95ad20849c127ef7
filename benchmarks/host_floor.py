"""The floor under the tiny replayed forward's row: what the least any replay could do costs on this machine, next to
moe-replay's replay, and where a context's cold cost goes.

    python benchmarks/host_floor.py   # about 6 minutes (--rounds N: 400 by default; --loops 0: parts 1-2 alone)

1. **Floor.** A bare replay of the tiny model (B=1, T=32, no grad): convert the routes' indices, set each router's
   forward to its redirected copy (redirect.py) whose top-k returns them, run the forward, remove the forwards. No
   checks and no bookkeeping: routes for another model or batch would replay wrongly with no error. It is timed with
   moe-replay's replayed forward with its context and with the plain forward in one loop, in a random order every
   round (main-thread CPU time, one torch thread); ratios are medians over rounds of the ratio within a round. Its
   logits are checked against moe-replay's first.
2. **A context's enter, cold.** The enter (construction and `__enter__`) is timed right after a plain forward, and
   again with one of its pieces run just before it, so that the piece is warm when the enter runs it: the drop is
   what that piece costs cold. The pieces are the hub's (hub.py) checks and state, each run as the enter runs it.
3. **Floor under recording.** A bare recording of the tiny model's `generate` (B=1, 32 new tokens, as host_cost.py
   times it): each router's forward set to one that appends its output's top-k indices to a list, removed after. No
   positions, no padding or EOS, no checks, no `Routes`: the least any recording through Python hooks does. Timed as
   host_cost.py times moe-replay's recording: one recorded generate and two plain ones per round, order reversed every
   round, a separate loop for each (`--generate-rounds`, `--loops` pairs of loops, alternating). Its indices are
   checked against moe-replay's routes first.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from host_cost import interleaved, paired_ratio
from run import TINY, build, generate_fn

from moe_replay import Routes, find_routers, record_routes, replay_routes
from moe_replay.engines.hf.layout import model_layout
from moe_replay.engines.hf.redirect import redirected_forward
from moe_replay.engines.hf.replay import columns_for


def bare_replay(model: torch.nn.Module, ids: torch.Tensor, routes: Routes) -> Callable[[], object]:
    """A forward replaying `routes` with nothing but the work itself (see the module docstring)."""
    gates = [site.router for site in find_routers(model)]
    copy = redirected_forward(type(gates[0]).forward)
    proxy, result = copy.torch_proxy, torch.return_types.topk

    def run(gate: torch.nn.Module, idx: torch.Tensor, *args: object, **kwargs: object) -> object:
        previous, proxy.topk = proxy.topk, lambda x, *a, **k: result((x.gather(-1, idx), idx))
        try:
            return copy(gate, *args, **kwargs)
        finally:
            proxy.topk = previous

    def forward() -> object:
        B, T, L, K = routes.indices.shape
        flat = routes.indices.reshape(B * T, L, K).transpose(0, 1)
        for gate, idx in zip(gates, flat.to(torch.long, memory_format=torch.contiguous_format).unbind(0), strict=True):
            gate.__dict__["forward"] = partial(run, gate, idx)
        try:
            return model(ids)
        finally:
            for gate in gates:
                del gate.__dict__["forward"]

    return forward


def bare_recording(model: torch.nn.Module, new: int) -> Callable[[], list[list[torch.Tensor]]]:
    """A generate (run.py's, B=1) whose routers' forwards append their top-k indices to a list per router, with
    nothing else (see part 3 of the module docstring); returns the lists."""
    gates = [site.router for site in find_routers(model)]
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))  # run.generate_fn's batch
    sampling = {"do_sample": True, "max_new_tokens": new, "min_new_tokens": new, "pad_token_id": 0}

    def appending(forward: Callable[..., object], into: list[torch.Tensor]) -> Callable[..., object]:
        def run(*args: object, **kwargs: object) -> object:
            out = forward(*args, **kwargs)
            into.append(out[2])  # (the tiny model's router returns logits, weights, indices)
            return out

        return run

    def generate() -> list[list[torch.Tensor]]:
        torch.manual_seed(2)
        got: list[list[torch.Tensor]] = [[] for _ in gates]
        for gate, into in zip(gates, got, strict=True):
            gate.__dict__["forward"] = appending(type(gate).forward.__get__(gate), into)
        try:
            model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **sampling)
        finally:
            for gate in gates:
                del gate.__dict__["forward"]
        return got

    return generate


def recording_floor(model: torch.nn.Module, rounds: int, loops: int) -> None:
    """Part 3: the bare recording and moe-replay's, each in host_cost.py's loop against two plain generates."""
    bare, ours, plain = (
        bare_recording(model, 32),
        generate_fn(model, 1, 32, "cpu", True),
        generate_fn(model, 1, 32, "cpu", False),
    )
    routes, calls = ours(), bare()
    for layer, per_call in enumerate(calls):  # prefill [32, K], then [1, K] per decode step
        if not torch.equal(torch.cat(per_call).long(), routes.indices[0, :-1, layer].long()):
            raise SystemExit(f"layer {layer}: the bare recording's indices differ from moe-replay's routes")
    print(f"\nrecording under generate (tiny, B=1, 32 new tokens), {rounds} rounds per loop, ratio to plain (A/A):")
    for n in range(loops):
        for name, fn in (("bare recording", bare), ("moe-replay", ours)):
            t = interleaved({"ours": fn, "plain": plain, "plain2": plain}, rounds)
            ratio, same = paired_ratio(t["ours"], t["plain"]), paired_ratio(t["plain2"], t["plain"])
            plain_ms = statistics.median(t["plain"]) * 1e3
            print(f"  loop {n + 1}, {name}: {ratio:.4f} (A/A {same:.4f}; plain generate {plain_ms:.1f} ms)", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=400)
    ap.add_argument("--generate-rounds", type=int, default=61, help="rounds of each loop in part 3 (host_cost's)")
    ap.add_argument("--loops", type=int, default=3, help="pairs of loops in part 3 (0: skip it)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_grad_enabled(False)
    model = build(TINY, "cpu")
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    with record_routes(model) as rec:
        model(ids)
    routes = rec.routes

    def ours() -> object:
        with replay_routes(model, routes):
            return model(ids)

    def plain() -> object:
        return model(ids)

    bare = bare_replay(model, ids, routes)
    if not torch.equal(bare().logits, ours().logits):
        raise SystemExit("the bare replay's logits differ from moe-replay's: it is not the same work")
    t = interleaved({"ours": ours, "bare": bare, "plain": plain, "plain2": plain}, args.rounds, random.Random(0))
    print(f"plain forward: {statistics.median(t['plain']) * 1e3:.2f} ms (tiny, B=1, T=32)")
    for name, label in (("ours", "moe-replay, a context per forward"), ("bare", "bare replay"), ("plain2", "A/A")):
        print(f"{label} / plain: {paired_ratio(t[name], t['plain']):.4f}")
    print(f"moe-replay / bare replay: {paired_ratio(t['ours'], t['bare']):.4f}")

    hub = model_layout(model).kept["hub"]
    pieces: dict[str, Callable[[], object]] = {
        "nothing": lambda: None,
        "the layout's stamp (model_layout)": lambda: model_layout(model),
        "the router classes unchanged (Unchanged.holds)": lambda: hub._watch[0].holds(),
        "the redirected forwards' globals (Redirects.refresh)": hub.redirects.refresh,
        "the hub's state (RouterHub._reset)": hub._reset,
        "the layers matched (columns_for)": lambda: columns_for(hub, routes.layers, type(model).__name__),
        "the context's construction": lambda: replay_routes(model, routes),
    }
    spent: dict[str, list[int]] = {name: [] for name in pieces}
    for _ in range(args.rounds // 2):
        for name in random.sample(list(pieces), len(pieces)):
            model(ids)
            pieces[name]()
            t0 = time.thread_time_ns()
            context = replay_routes(model, routes)
            context.__enter__()
            spent[name].append(time.thread_time_ns() - t0)
            model(ids)
            context.__exit__(None, None, None)
    cold = statistics.median(spent.pop("nothing")) / 1e3
    print(f"\ncontext construction and enter, right after a plain forward: {cold:.1f} us; less with a piece warm:")
    for name, times in spent.items():
        print(f"  {name}: {cold - statistics.median(times) / 1e3:.1f} us")
    if args.loops:
        recording_floor(model, args.generate_rounds, args.loops)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
