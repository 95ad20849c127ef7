"""What recording and replay cost, and how small Routes are. Prints a table, writes it as CSV, ends with
`targets met: N/M`.

    python benchmarks/run.py            # the README's table (a few minutes on 2 CPU cores)
    python benchmarks/run.py --quick    # the same table from smaller runs (under two minutes)
    python benchmarks/run.py --expert-change   # the expert_change row alone (seconds), printed, no CSV

Each cost is a ratio against the same work without moe-replay, measured side by side in one process, alternating
the order, median over repeats; an A/A row (the plain run against itself) shows the timing noise of the machine.
Peak memory is measured in fresh subprocesses (peak RSS on CPU, peak allocated on CUDA).
"""

from __future__ import annotations

import argparse
import csv
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from moe_replay import LayerInfo, Routes, expert_change, record_routes, replay_routes
from moe_replay.tiny import tiny_moe

REALISTIC = dict(
    hidden_size=512,
    intermediate_size=1024,
    moe_intermediate_size=256,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=64,
    num_experts=64,
    num_experts_per_tok=8,
)
TINY: dict = {}  # moe_replay.tiny's default shape: 4 layers, hidden 64, 16 experts of width 32, top-2


def build(spec: dict, device: str) -> torch.nn.Module:
    """A Qwen3-MoE of the shape `spec` (config fields) over a 1024-token vocabulary, seed 0, grouped_mm experts."""
    return tiny_moe(0, vocab=1024, experts_implementation="grouped_mm", **spec).to(device).eval()


def paired(a: Callable[[], object], b: Callable[[], object], repeats: int, device: str) -> tuple[float, float]:
    """Median seconds of `a` (ours) and `b` (baseline), run alternately (order flipped every repeat) after a warm-up."""
    a(), b()
    ta, tb = [], []
    for r in range(repeats):
        for fn, out in ((a, ta), (b, tb)) if r % 2 else ((b, tb), (a, ta)):
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            out.append(time.perf_counter() - t0)
    return statistics.median(ta), statistics.median(tb)


def sync(device: str) -> None:
    """Wait for `device`'s queued work if it is a CUDA device (nothing to wait for on the CPU)."""
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def child_stdout(cmd: list[str], env: dict[str, str] | None = None) -> str:
    """The stdout of `cmd` run to completion; a failed child raises with the end of its stderr (not only its code)."""
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return done.stdout


def write_rows(path: Path, rows: list[dict], fieldnames: list[str] | None = None) -> None:
    """Write `rows` as CSV to `path`, a header first (the first row's keys, in order, unless `fieldnames` is given)."""
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fieldnames or list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def generate_fn(model: torch.nn.Module, batch: int, new: int, device: str, record: bool) -> Callable[[], object]:
    ids = torch.randint(1, 1024, (batch, 32), generator=torch.Generator().manual_seed(1)).to(device)

    def run() -> object:
        torch.manual_seed(2)
        sampling = {"do_sample": True, "max_new_tokens": new, "min_new_tokens": new, "pad_token_id": 0}
        with torch.no_grad():
            if record:
                with record_routes(model) as rec:
                    model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **sampling)
                return rec.routes
            return model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **sampling)

    return run


def peak_memory(spec: str, batch: int, new: int, device: str, record: bool) -> int:
    """Peak memory (bytes) of one generate in a fresh subprocess: peak RSS on CPU, peak allocated on CUDA."""
    cmd = [sys.executable, __file__, "--_peak", spec, str(batch), str(new), device, "1" if record else "0"]
    out = child_stdout(cmd, env={**os.environ, "TQDM_DISABLE": "1"})
    return int(out.strip().splitlines()[-1])


def _peak_child(spec: str, batch: int, new: int, device: str, record: bool) -> None:
    model = build(REALISTIC if spec == "realistic" else TINY, device)
    generate_fn(model, batch, new, device, record)()
    if device.startswith("cuda"):
        print(torch.cuda.max_memory_allocated())
    else:
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)


EXPERT_CHANGE = "expert_change on 1.05e7 entries [64, 2048, 10, 8]"


def expert_change_seconds(repeats: int = 3) -> float:
    """Median seconds of `expert_change` and its three measures (fraction, set_changed, token_changed) on 1.05e7
    routed entries, [64, 2048, 10, 8] of 64 experts, against the same routes with the batch rolled by one row."""
    a = torch.rand(64, 2048, 10, 64, generator=torch.Generator().manual_seed(0)).argsort(-1)[..., :8]
    ra = Routes(a, torch.ones(64, 2048, dtype=torch.bool), [LayerInfo(f"l{i}", 64, 8) for i in range(10)])
    rb = Routes(a.roll(1, 0), ra.mask, ra.layers)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        c = expert_change(ra, rb)
        _ = (c.fraction, c.set_changed, c.token_changed)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smaller runs, same table (under two minutes)")
    ap.add_argument("--csv", type=Path, default=None, help="default: benchmarks/results.csv, or results_quick.csv")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--expert-change", action="store_true", help="time the expert_change row alone (printed, no CSV)")
    ap.add_argument("--_peak", nargs=5, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._peak:
        spec, batch, new, device, record = args._peak
        _peak_child(spec, int(batch), int(new), device, record == "1")
        return 0
    if args.expert_change:  # CPU tensors, whatever --device says (as in the table)
        print(f"{EXPERT_CHANGE}: {expert_change_seconds():.4g} s (median of 3), {torch.get_num_threads()} threads")
        return 0

    q, dev = args.quick, args.device
    new_real, reps_gen = (16, 3) if q else (128, 5)
    rows: list[dict] = []

    def add(metric: str, ours: float, base: float | None, unit: str, target: str, met: bool | None) -> None:
        ratio = ours / base if base else float("nan")
        rows.append(
            {
                "metric": metric,
                "ours": ours,
                "baseline": base,
                "unit": unit,
                "ratio": ratio,
                "target": target,
                "met": "" if met is None else ("yes" if met else "NO"),
            }
        )
        print(
            f"  {metric}: {ours:.4g} vs {base if base is None else f'{base:.4g}'} {unit} (ratio {ratio:.3f})",
            flush=True,
        )

    print(f"device {dev}, {torch.get_num_threads()} threads, torch {torch.__version__}{' (quick)' if q else ''}")
    real = build(REALISTIC, dev)
    ours, base = paired(
        generate_fn(real, 16, new_real, dev, True), generate_fn(real, 16, new_real, dev, False), reps_gen, dev
    )
    add(
        f"generate + record, 8L h512 E64 k8, B16, {new_real} new tokens",
        ours,
        base,
        "s",
        "ratio <= 1.03",
        ours / base <= 1.03,
    )
    plain = generate_fn(real, 16, new_real, dev, False)
    ours, base = paired(plain, generate_fn(real, 16, new_real, dev, False), reps_gen, dev)
    add("  noise floor: the same plain generate against itself", ours, base, "s", "(A/A)", None)
    tiny = build(TINY, dev)
    ours, base = paired(
        generate_fn(tiny, 16, 64, dev, True), generate_fn(tiny, 16, 64, dev, False), 5 if q else 11, dev
    )
    add("generate + record, tiny 4L h64 E16 k2, B16, 64 new tokens", ours, base, "s", "(none)", None)
    mem_new = 16 if q else new_real
    ours = peak_memory("realistic", 16, mem_new, dev, True)
    base = peak_memory("realistic", 16, mem_new, dev, False)
    add(
        f"peak memory, generate + record (realistic, {mem_new} new)",
        ours / 2**20,
        base / 2**20,
        "MiB",
        "ratio <= 1.03",
        ours / base <= 1.03,
    )

    B, T = (4, 128) if q else (16, 256)
    ids = torch.randint(1, 1024, (B, T), generator=torch.Generator().manual_seed(3)).to(dev)
    real.train()
    with torch.no_grad(), record_routes(real) as rec:
        real(ids)
    routes = rec.routes

    def fwd_bwd(replay: bool) -> Callable[[], None]:
        def run() -> None:
            real.zero_grad(set_to_none=True)
            if replay:
                with replay_routes(real, routes):
                    real(ids, labels=ids).loss.backward()
            else:
                real(ids, labels=ids).loss.backward()

        return run

    ours, base = paired(fwd_bwd(True), fwd_bwd(False), 3 if q else 5, dev)
    add(f"forward + backward + replay, realistic, {B} x {T}", ours, base, "s", "ratio <= 1.02", ours / base <= 1.02)
    ours, base = paired(fwd_bwd(False), fwd_bwd(False), 3 if q else 5, dev)
    add("  noise floor: the same plain forward + backward against itself", ours, base, "s", "(A/A)", None)

    L, K, E = 8, 8, 64
    per_token = routes.nbytes / (routes.batch_size * routes.seq_len)
    add(
        "Routes bytes per token (L=8, K=8, E=64) vs K bytes per layer + mask",
        per_token,
        L * K + 1,
        "B",
        "== L*K + 1",
        per_token == L * K + 1,
    )
    add("Routes bytes per token vs fp32 router logits (E per layer)", per_token, L * E * 4, "B", "(none)", None)
    add("Routes bytes per token vs int64 indices", per_token, L * K * 8 + 1, "B", "(none)", None)

    gb = 0.0625 if q else 1.0
    n_tok = int(gb * 2**30 / (L * K + 1))
    big = Routes(
        ((torch.randint(0, E, (n_tok // 1024, 1024, L, 1)) + torch.arange(K)) % E).to(torch.uint8),  # distinct
        torch.ones(n_tok // 1024, 1024, dtype=torch.bool),
        tuple(LayerInfo(f"model.layers.{i}.mlp.gate", E, K) for i in range(L)),
    )
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routes.safetensors"
        t0 = time.perf_counter()
        big.save(path)
        t_save = time.perf_counter() - t0
        t0 = time.perf_counter()
        back = Routes.load(path)
        t_load = time.perf_counter() - t0
        t0 = time.perf_counter()
        Routes.load(path, validate=False)
        t_fast = time.perf_counter() - t0
        assert torch.equal(back.indices, big.indices)
        size = path.stat().st_size
        t0 = time.perf_counter()
        torch.save({"indices": big.indices, "mask": big.mask}, Path(tmp) / "torch.pt")
        t_base = time.perf_counter() - t0
    add(f"save {size / 2**30:.2f} GiB Routes file", size / 2**30 / t_save, None, "GiB/s", "(none)", None)
    add(f"load {size / 2**30:.2f} GiB Routes file (validated)", size / 2**30 / t_load, None, "GiB/s", "(none)", None)
    add(
        f"load {size / 2**30:.2f} GiB Routes file (validate=False: memory-mapped, read lazily)",
        size / 2**30 / t_fast,
        None,
        "GiB/s",
        "(none)",
        None,
    )
    add("save time vs torch.save of the same tensors", t_save, t_base, "s", "(none)", None)

    add(EXPERT_CHANGE, expert_change_seconds(), None, "s", "(none)", None)

    if args.csv is None:  # a quick run never overwrites the committed full results
        args.csv = Path("benchmarks/results_quick.csv" if args.quick else "benchmarks/results.csv")
    args.csv.parent.mkdir(parents=True, exist_ok=True)
    write_rows(args.csv, rows)
    print()
    print("| metric | ours | baseline | unit | ratio | target | met? |\n|---|---|---|---|---|---|---|")
    for r in rows:
        base = "" if r["baseline"] is None else f"{r['baseline']:.4g}"
        ratio = "" if r["baseline"] is None else f"{r['ratio']:.3f}"
        print(f"| {r['metric']} | {r['ours']:.4g} | {base} | {r['unit']} | {ratio} | {r['target']} | {r['met']} |")
    targets = [r for r in rows if r["met"]]
    print(f"\nwrote {args.csv}")
    print(f"targets met: {sum(r['met'] == 'yes' for r in targets)}/{len(targets)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
