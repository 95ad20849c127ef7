"""What recording and replay add to a small forward, in CPU instructions counted by valgrind: a measure of host work
that does not move with the machine's state (timed ratios on a shared 2-core machine swing by 5-10% from run to run).

    python benchmarks/host_instructions.py                     # both models (about 75 minutes on one core)
    python benchmarks/host_instructions.py --models tiny       # one model (tiny: about 15 minutes; a realistic row
                                                               # takes about 20, two processes under valgrind)
    python benchmarks/host_instructions.py --works "record generate"   # some works; rows run replace the same rows
                                                                       # in the CSV, the others are kept
    python benchmarks/host_instructions.py --models group --works "replay forward"   # group-limited routing
                                                                       # (DeepSeek-V3 of the tiny shape)

Needs `valgrind` (callgrind), a C compiler and valgrind's `callgrind.h` (Debian: `apt install valgrind gcc`). Each
work runs in its own process under `valgrind --tool=callgrind --instr-atstart=no`: the imports, the model build and
three warm-up repetitions run uninstrumented, then instructions are counted over N repetitions only (a client request
from a tiny C helper, loaded with ctypes, switches counting on and off). Counts are exact for one process; the only
noise left is when Python's garbage collector happens to run, which the repetitions average over.
Works (B=1, T=32, no grad, as in host_cost.py): a replayed forward with the context opened around it, 10 replayed
forwards in one context, recording under `generate` of 32 new tokens, each against the same work without moe-replay.
Writes benchmarks/results_host_instructions.csv (or --csv). `--no-gc` collects, then turns the garbage collector off
while counting: the counts then repeat exactly from run to run (for comparing two versions of the code; the CSV rows
keep the collector on, as users run).
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HELPER = r"""
#include <valgrind/callgrind.h>
void start(void) { CALLGRIND_ZERO_STATS; CALLGRIND_START_INSTRUMENTATION; }
void stop(void) { CALLGRIND_STOP_INSTRUMENTATION; CALLGRIND_DUMP_STATS; }
"""
WORKS = {  # name: (ours, plain, repetitions on the tiny model, router calls per repetition per layer)
    "replay forward": ("replay", "plain", 5, 1),
    "replay forward, 10 per context": ("held", "plain10", 2, 10),
    "record generate": ("record_generate", "generate", 2, 32),
}


def build_group() -> object:
    """A DeepSeek-V3 of the tiny model's shape (4 layers, hidden 64, 16 experts, top-2), with group-limited routing:
    4 groups of 4 experts, the best 2 groups kept; seed 0, a 1024-token vocabulary."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=1024, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16, num_experts_per_tok=2, n_group=4,
        topk_group=2, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0,
    )  # fmt: skip
    return DeepseekV3ForCausalLM(config).eval()


def child(work: str, model_name: str, reps: int, helper: str, collect: bool) -> None:
    """Run `work` `reps` times with callgrind counting (this process runs under valgrind), with the garbage collector
    on or not (`collect`)."""
    import gc

    import torch
    from run import REALISTIC, TINY, build, generate_fn

    from moe_replay import record_routes, replay_routes

    torch.set_num_threads(1)
    model = build_group() if model_name == "group" else build(TINY if model_name == "tiny" else REALISTIC, "cpu")
    ids = torch.randint(1, 1024, (1, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    routes = rec.routes

    def forwards(n: int, replay: bool) -> None:
        with torch.no_grad():
            if replay:
                with replay_routes(model, routes):
                    for _ in range(n):
                        model(ids)
            else:
                for _ in range(n):
                    model(ids)

    fns = {
        "plain": lambda: forwards(1, False),
        "replay": lambda: forwards(1, True),
        "plain10": lambda: forwards(10, False),
        "held": lambda: forwards(10, True),
        "generate": generate_fn(model, 1, 32, "cpu", False),
        "record_generate": generate_fn(model, 1, 32, "cpu", True),
    }
    fn = fns[work]
    for _ in range(3):
        fn()
    lib = ctypes.CDLL(helper)
    if not collect:
        gc.collect()
        gc.disable()
    lib.start()
    for _ in range(reps):
        fn()
    lib.stop()


def count(work: str, model_name: str, reps: int, helper: str, collect: bool = True) -> float:
    """Instructions per repetition of `work`, from a fresh process under callgrind."""
    return counted(__file__, ["--child", work, model_name, str(reps), helper, "gc" if collect else "no-gc"], reps)


def counted(script: str, args: list[str], reps: int) -> float:
    """Instructions per repetition that `python script *args` counts between the helper's start and stop, run under
    callgrind in a fresh process (one thread, this folder on the path)."""
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", "--callgrind-out-file=/dev/null", sys.executable,
           script, *args]  # fmt: skip
    path = os.pathsep.join(p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": path}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    found = re.search(r"Collected : (\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"{' '.join(cmd[-4:])} failed:\n{out.stderr[-2000:]}")
    return int(found.group(1)) / reps


def build_helper(where: Path) -> str:
    """Compile the start/stop helper; a clear error if the tools are missing."""
    missing = [tool for tool in ("valgrind", "cc") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"host_instructions.py needs {missing} on PATH (Debian: apt install valgrind gcc)")
    (where / "helper.c").write_text(HELPER)
    lib = where / "helper.so"
    made = subprocess.run(["cc", "-shared", "-fPIC", "-O2", "-o", str(lib), str(where / "helper.c")],
                          capture_output=True, text=True, check=False)  # fmt: skip
    if made.returncode != 0:
        raise SystemExit(f"could not build the callgrind helper (is valgrind's callgrind.h installed?):\n{made.stderr}")
    return str(lib)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5], sys.argv[6] == "gc")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", choices=["tiny", "realistic", "group"], default=["tiny", "realistic"])
    ap.add_argument("--works", nargs="+", choices=list(WORKS), default=list(WORKS), help="default: all three")
    ap.add_argument("--csv", type=Path, default=Path(__file__).with_name("results_host_instructions.csv"))
    ap.add_argument("--no-gc", action="store_true", help="garbage collector off while counting (exact repeats)")
    args = ap.parse_args()
    layers = {"tiny": 4, "realistic": 8, "group": 4}
    models = args.models
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        helper = build_helper(Path(tmp))
        for model_name in models:
            for work in args.works:
                ours, plain, reps, per_layer = WORKS[work]
                reps = max(1, reps // (2 if model_name == "realistic" else 1))
                collect = not args.no_gc
                a, b = count(ours, model_name, reps, helper, collect), count(plain, model_name, reps, helper, collect)
                row = {
                    "work": f"{work}, {model_name}, B=1",
                    "ours_minstr": round(a / 1e6, 3),
                    "plain_minstr": round(b / 1e6, 3),
                    "ratio": round(a / b, 4),
                    "extra_kinstr_per_router_call": round((a - b) / (layers[model_name] * per_layer) / 1e3, 1),
                }
                rows.append(row)
                print(" | ".join(str(v) for v in row.values()), flush=True)
    out = args.csv
    if out.exists():  # keep the rows of the other works and models
        with out.open() as f:
            done = {r["work"] for r in rows}
            rows = [r for r in csv.DictReader(f) if r["work"] not in done] + rows
    from run import write_rows

    write_rows(out, rows)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
