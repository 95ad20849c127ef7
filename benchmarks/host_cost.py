"""What recording and replay cost per router call at small batches, where a router call's fixed host cost is not
hidden behind compute (a decode step, a chunked log-prob forward): timed (the default), in CPU instructions counted
under valgrind's callgrind (`--count`), or in calls (`--calls`). Timed, it prints the host microseconds moe-replay
adds per router call, writes a CSV and ends with `targets met: N/M`.

    python benchmarks/host_cost.py           # benchmarks/results_host_cost.csv (3-15 minutes on 2 CPU cores)
    python benchmarks/host_cost.py --quick   # fewer repeats (a few minutes); writes results_host_cost_quick.csv
    python benchmarks/host_cost.py --count   # both models (about 60 minutes): benchmarks/results_host_instructions.csv
    python benchmarks/host_cost.py --count --models tiny --works "record generate"   # some rows (tiny: about 10
                                             # minutes a seed); the rows run replace the same rows in the CSV
    python benchmarks/host_cost.py --count --models group   # group-limited routing (DeepSeek-V3 of the tiny shape)
    python benchmarks/host_cost.py --calls --top 20   # calls added on the tiny model, the 20 largest named (seconds)

The works (B=1, no grad, in eval, inside a `keep_warm` scope on the model whose contexts also ran it in training, as a
training loop's do: the MoE blocks then run unwrapped; the cold row of `--count` outside one): a replayed forward of
T=32 tokens with the context opened and closed around it (a log-prob chunk, a minibatch), 10 replayed forwards in one
context, recording under `generate` of 32 new tokens; each against the same work without moe-replay. Timed: all the
forward variants of a model run in one loop (order reversed every round), and so do the generate variants; a ratio is
the median over rounds of ours / plain within the round, and an A/A row compares two copies of the plain work from the
same loop. Times are the main thread's CPU time on one torch thread (`time.thread_time`), the ms columns medians over
rounds; `--device cuda`: wall seconds between synchronizations on the GPU. Extra host time per router call = (ratio - 1)
x the plain work's median / the router calls in the work (L per forward; L per decode step under generate).
`--count`: ours and plain counted in turn in one process under callgrind per hash seed (benchmarks/callgrind.py;
needs valgrind and a C compiler), each round of each counted on its own after the imports, the build and 3 uncounted
ones: both see one memory layout, which moves a count by ~0.5% between processes, as much as a replay adds. A row is
the mean over rounds and seeds of ours - plain per router call, with its standard error (`--seeds N`: more of
them). Counts do not move with the machine's state; the rest of the noise is where Python's garbage collector runs
(`--no-gc` turns it off while counting, to compare two versions of the code; the CSV's rows keep it on, as users
run).
`--calls`: the Python and C calls (`sys.setprofile`) and torch functions (a `TorchFunctionMode`) in one repetition
of each work on the tiny model after warm-up, ours against plain: the same every run, and `--top N` names them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from call_counts import TorchCalls, python_calls
from callgrind import build_helper, counted_together, run_together
from run import REALISTIC, TINY, build, generate_fn, sync, write_rows

import moe_replay
from moe_replay import record_routes, replay_routes

# (an older checkout on PYTHONPATH, counted by this harness for a before/after row, may predate `keep_warm`: its hub
# kept what contexts learned on the model, as a scope does now)
keep_warm = getattr(moe_replay, "keep_warm", lambda model: contextlib.nullcontext())

TARGETS = {  # issue 18: (work, model) -> largest ratio
    ("replay forward", "tiny"): 1.08,
    ("replay forward", "realistic"): 1.02,
    ("replay forward, 10 per context", "tiny"): 1.08,
    ("replay forward, 10 per context", "realistic"): 1.02,
    ("record generate", "tiny"): 1.02,
    ("record generate", "realistic"): 1.02,
}
HELD = 10  # forwards per held-open context in the second replay row
COUNTED = {  # --count: work -> (ours, plain, rounds on the tiny model (half on the realistic one), router calls per
    # repetition per layer)
    "replay forward": ("ours", "plain", 6, 1),
    f"replay forward, {HELD} per context": ("held", "plain_held", 4, HELD),
    "record generate": ("record", "generate", 4, 32),
    "replay forward, cold": ("ours", "plain", 6, 1),  # outside any keep_warm scope: each context walks the model
}
LAYERS = {"tiny": 4, "realistic": 8, "group": 4}


def interleaved(fns: dict[str, Callable[[], object]], repeats: int, device: str = "cpu") -> dict[str, list[float]]:
    """Main-thread CPU seconds of each function in every round, all run in one loop (order reversed every round,
    after a warm-up), so that every row compares work done under the same machine state. On a CUDA `device`, wall
    seconds from a synchronized start to a synchronized end instead (host time the GPU's queue does not hide)."""
    clock = time.perf_counter if device.startswith("cuda") else time.thread_time
    for fn in fns.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(repeats):
        for name in list(fns) if r % 2 else list(fns)[::-1]:
            sync(device)
            t0 = clock()
            fns[name]()
            sync(device)
            times[name].append(clock() - t0)
    return times


def paired_ratio(ours: list[float], plain: list[float]) -> float:
    """The median over rounds of ours / plain in the same round: this machine drifts between a fast and a slow state
    (a plain forward takes 4-10 ms) on a scale of seconds, which a ratio of two medians mixes in and a ratio within
    a round cancels."""
    return statistics.median(a / b for a, b in zip(ours, plain, strict=True))


def model_named(name: str, device: str = "cpu") -> torch.nn.Module:
    """`tiny` or `realistic` (benchmarks/run.py's shapes), or `group`: a DeepSeek-V3 of the tiny model's shape (4
    layers, hidden 64, 16 experts, top-2) with group-limited routing (4 groups of 4 experts, the best 2 kept), seed 0,
    a 1024-token vocabulary."""
    if name != "group":
        return build(TINY if name == "tiny" else REALISTIC, device)
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config).eval().to(device)


def works(model: torch.nn.Module, device: str = "cpu") -> dict[str, Callable[[], object]]:
    """On `model`, with one [1, 32] batch, no grad: a replayed forward with the context opened and closed around it
    (`ours`), `HELD` replayed forwards in one context (`held`), one plain forward (`plain`), `HELD` plain forwards
    (`plain_held`), recording under `generate` of 32 new tokens (`record`) and the plain `generate`."""
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes = rec.routes
    model.train()  # (a training loop's contexts see the model in both modes: its blocks are then known in both)
    with torch.no_grad(), record_routes(model):
        model(ids)
    model.eval()

    def ours() -> None:
        with torch.no_grad(), replay_routes(model, routes):
            model(ids)

    def held() -> None:
        with torch.no_grad(), replay_routes(model, routes):
            for _ in range(HELD):
                model(ids)

    def plain() -> None:
        with torch.no_grad():
            model(ids)

    def plain_held() -> None:
        with torch.no_grad():
            for _ in range(HELD):
                model(ids)

    record, generate = (generate_fn(model, 1, 32, device, rec) for rec in (True, False))
    return dict(ours=ours, held=held, plain=plain, plain_held=plain_held, record=record, generate=generate)


def timed(args: argparse.Namespace, stack: contextlib.ExitStack) -> int:
    """The timed rows of both models (the module's docstring)."""
    reps_fwd, reps_gen = (100, 5) if args.quick else (400, 61)
    torch.set_num_threads(args.threads)
    rows, met = [], []
    for label in ("tiny", "realistic"):
        model = model_named(label, args.device)
        stack.enter_context(keep_warm(model))
        fns = works(model, args.device)
        layers = model.config.num_hidden_layers
        scale = 1 if label == "tiny" else 2  # the realistic forward is about 15x slower: fewer repeats (8 rounds
        # were too few: an A/A row at 1.077). The tiny rows take 400 rounds (26 s): medians of 80 rounds of one run
        # ranged 1.071-1.097 for the same replayed forward
        rounds = reps_fwd if label == "tiny" else reps_fwd // scale // HELD * 2
        order = ("ours", "held", "plain", "plain2", "plain_held")  # plain2: the A/A row's second plain forward
        forwards = interleaved({n: fns[n.removesuffix("2")] for n in order}, max(5, rounds), device=args.device)
        generates = interleaved(
            {
                "record": fns["record"],
                "plain": fns["generate"],
                "plain2": generate_fn(model, 1, 32, args.device, False),
            },
            max(5, reps_gen * 2 // (scale + 1)),  # 61 rounds tiny, 40 realistic (21 left an A/A row at 0.972)
            device=args.device,
        )
        for work, (t_ours, t_base), calls in (
            ("replay forward", (forwards["ours"], forwards["plain"]), layers),
            (f"replay forward, {HELD} per context", (forwards["held"], forwards["plain_held"]), layers * HELD),
            ("A/A forward", (forwards["plain2"], forwards["plain"]), layers),
            ("record generate", (generates["record"], generates["plain"]), layers * 32),
            ("A/A generate", (generates["plain2"], generates["plain"]), layers * 32),
        ):
            target = TARGETS.get((work, label))
            ratio = paired_ratio(t_ours, t_base)
            base = statistics.median(t_base)
            ok = None if target is None else ratio <= target
            if ok is not None:
                met.append(ok)
            row = {
                "work": f"{work}, {label}, B=1" + (", T=32" if "forward" in work else ", 32 new tokens"),
                "ours_ms": round(statistics.median(t_ours) * 1e3, 3),
                "plain_ms": round(base * 1e3, 3),
                "ratio": round(ratio, 3),
                "extra_us_per_router_call": round((ratio - 1) * base / calls * 1e6, 1),
                "target": "" if target is None else f"<= {target}",
                "met": "" if ok is None else ("yes" if ok else "NO"),
            }
            rows.append(row)
            print(" | ".join(str(v) for v in row.values()), flush=True)
    out = args.csv or Path(__file__).with_name("results_host_cost_quick.csv" if args.quick else "results_host_cost.csv")
    write_rows(out, rows)
    print(f"targets met: {sum(met)}/{len(met)}")
    return 0


def count(args: argparse.Namespace) -> int:
    """--count: instructions of each work, ours and plain counted in turn in one fresh process under callgrind per
    hash seed (their difference is then free of the layout noise between processes): per router call, the mean of
    the rounds' differences and its standard error."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        helper = build_helper(Path(tmp))
        for name in args.models:
            for work in args.works:
                ours, plain, reps, per_layer = COUNTED[work]
                reps = max(2, reps // (2 if name == "realistic" else 1))
                flag = "no-gc" if args.no_gc else "gc"
                scope = "cold" if work.endswith("cold") else "warm"
                child = ["--_child", f"{ours},{plain}", name, str(reps), helper, flag, scope]
                a, b = [], []
                for seed in range(args.seeds):
                    found = counted_together(__file__, child, [ours, plain], reps, seed)
                    a, b = a + found[ours], b + found[plain]
                calls = LAYERS[name] * per_layer
                extra = [(x - y) / calls / 1e3 for x, y in zip(a, b, strict=True)]
                row = {
                    "work": f"{work}, {name}, B=1",
                    "ours_minstr": round(statistics.mean(a) / 1e6, 3),
                    "plain_minstr": round(statistics.mean(b) / 1e6, 3),
                    "ratio": round(sum(a) / sum(b), 4),
                    "extra_kinstr_per_router_call": round(statistics.mean(extra), 1),
                    "standard_error": round(statistics.stdev(extra) / len(extra) ** 0.5, 1),
                    "rounds": len(extra),
                }
                rows.append(row)
                print(" | ".join(str(v) for v in row.values()), flush=True)
    out = args.csv or Path(__file__).with_name("results_host_instructions.csv")
    if out.exists():  # keep the rows of the other works and models
        with out.open() as f:
            done = {r["work"] for r in rows}
            rows = [r for r in csv.DictReader(f) if r["work"] not in done] + rows
    write_rows(out, rows, list(rows[-1]))  # (the columns of the rows just counted)
    print(f"wrote {out}")
    return 0


def calls(top: int, stack: contextlib.ExitStack) -> int:
    """--calls: the calls and torch functions each work adds on the tiny model, per repetition and per router call."""
    torch.set_num_threads(1)
    model = model_named("tiny")
    stack.enter_context(keep_warm(model))
    fns, L = works(model), model.config.num_hidden_layers
    print("work (tiny, B=1) | calls (Python and C): ours / plain | extra per router call | torch functions: "
          "ours / plain")  # fmt: skip
    for name, (ours, plain, _, per_layer) in COUNTED.items():
        if name.endswith("cold"):
            continue  # (calls inside the scope only)
        mine, without = fns[ours], fns[plain]
        for fn in (mine, without, mine, without):  # warm-up: the first contexts learn the router class's facts
            fn()
        seen = {}
        for label, fn in (("ours", mine), ("plain", without)):
            with TorchCalls() as mode:
                fn()
            seen[label] = (python_calls(fn), mode.seen)
        (py_ours, t_ours), (py_plain, t_plain) = seen["ours"], seen["plain"]
        n_ours, n_plain = sum(py_ours.values()), sum(py_plain.values())
        print(f"{name} | {n_ours} / {n_plain} | {(n_ours - n_plain) / (L * per_layer):.1f} | "
              f"{sum(t_ours.values())} / {sum(t_plain.values())}")  # fmt: skip
        if top:
            for where, n in ((py_ours - py_plain) + Counter()).most_common(top):
                print(f"    +{n} {where}")
            print(f"    torch functions added: {dict(t_ours - t_plain)}, removed: {dict(t_plain - t_ours)}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--count", action="store_true", help="CPU instructions under callgrind instead of time")
    mode.add_argument("--calls", action="store_true", help="Python and C calls and torch functions (tiny model)")
    ap.add_argument("--quick", action="store_true", help="fewer repeats (a few minutes)")
    ap.add_argument("--csv", type=Path, default=None, help="default: results_host_cost[_quick].csv, --count: "
                    "results_host_instructions.csv (in benchmarks/)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: thread_time sees all work)")
    ap.add_argument("--device", default="cpu", help="cuda: the same rows on a GPU, in wall seconds (synchronized)")
    ap.add_argument("--models", nargs="+", choices=list(LAYERS), default=["tiny", "realistic"], help="--count's models")
    ap.add_argument("--works", nargs="+", choices=list(COUNTED), default=list(COUNTED), help="--count's (all four)")
    ap.add_argument("--no-gc", action="store_true", help="--count: collector off while counting (exact repeats)")
    ap.add_argument("--seeds", type=int, default=1, help="--count: average over hash seeds 0..N-1 (default 1)")
    ap.add_argument("--top", type=int, default=0, help="--calls: also list the N functions that add the most calls")
    ap.add_argument("--_child", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        work, name, reps, helper, flag, scope = args._child  # this process runs under valgrind, counting `work`
        torch.set_num_threads(1)
        model = model_named(name)
        with keep_warm(model) if scope == "warm" else contextlib.nullcontext():
            run_together([works(model)[w] for w in work.split(",")], int(reps), helper, collect=flag == "gc")
        return 0
    with contextlib.ExitStack() as stack:  # the keep_warm scopes of the models measured
        return count(args) if args.count else calls(args.top, stack) if args.calls else timed(args, stack)


if __name__ == "__main__":
    raise SystemExit(main())
