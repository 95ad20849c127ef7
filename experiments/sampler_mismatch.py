"""How far an engine-like sampler is from the fp32 trainer, on the RL loop's warm-started 4-layer policy: routing
mismatch (share of routed expert choices that differ), KL(sampler ‖ trainer) by k3, and |log-ratio| on the sampled
answer tokens, for bf16, fp16 and fp8-rounded samplers. The fp8 samplers simulate an engine; they are not one.

    python experiments/sampler_mismatch.py --preset quick   # 10-step warm start, 4 prompts x 2 answers: a smoke test
    python experiments/sampler_mismatch.py                  # (--preset full) 64 prompts x 8 answers per sampler
    python experiments/sampler_mismatch.py --init runs/init # from another warm-started policy (save_pretrained folder)
    python experiments/sampler_mismatch.py --out experiments/results   # replace the committed table
    python experiments/sampler_mismatch.py --replot         # print the committed table

Starts from the cached warm start of mechanism.py and expert_change.py's 4-layer variant (300 steps on 3-digit
addition; made under --runs, default runs/warm_starts, if missing) or from --init. Writes <out>/sampler_mismatch.csv
(default runs/results; the committed one is experiments/results/sampler_mismatch.csv, the table in docs/rl.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from common import WARM_STARTS, committed, parse_args, warm_started, write_table

from moe_replay import expert_change, teacher_forced_routes
from moe_replay.rl.sampler import make_sampler, mismatch_metrics
from moe_replay.rl.step import rollout
from moe_replay.rl.tasks import Task

SAMPLERS = [
    ("float32", "none"),
    ("bfloat16", "none"),
    ("float16", "none"),
    ("float32", "fp8_e4m3"),
    ("bfloat16", "fp8_e4m3"),
    ("bfloat16", "fp8_e5m2"),
]
PRESETS = {
    "quick": {"prompts": 4, "group_size": 2, "warm_steps": 10},
    "full": {"prompts": 64, "group_size": 8, "warm_steps": 300},
}


def options(ap: argparse.ArgumentParser) -> None:
    """sampler_mismatch.py's own option: `--init`.

    Example:
        >>> args = parse_args(__doc__, PRESETS, runs=WARM_STARTS, extra=options)  # doctest: +SKIP
    """
    ap.add_argument(
        "--init", type=Path, help="a warm-started policy (save_pretrained folder) instead of the cached one"
    )


def measure(init: Path, prompts: int, group_size: int, progress: bool = True) -> pd.DataFrame:
    """Each sampler of `SAMPLERS` against the fp32 trainer `init` on the same `prompts` x `group_size` sampled
    answers: the share of routed expert choices that differ, of tokens with one, and the log-prob mismatch.

    Example:
        >>> measure(Path("runs/warm_starts/init_L4_E16_k2_w300_seed0"), 64, 8)  # doctest: +SKIP
    """
    from transformers import AutoModelForCausalLM

    task = Task("addition", 3)
    model = AutoModelForCausalLM.from_pretrained(init).eval()
    prompt_ids, answers = task.sample(prompts, torch.Generator().manual_seed(123))
    rows = []
    for dtype, quant in SAMPLERS:
        torch.manual_seed(0)
        sampler = make_sampler(model, dtype, quant)
        batch = rollout(model, task, prompt_ids, answers, group_size=group_size, sampler=sampler)
        live = teacher_forced_routes(model, batch.sequences)
        change = expert_change(batch.routes, live)
        row = {
            "sampler": f"{dtype}{'' if quant == 'none' else ' + ' + quant}",
            "routing_mismatch": change.fraction,
            "tokens_with_a_moved_expert": change.token_changed,
            **mismatch_metrics(batch.trainer_logp, batch.sampler_logp, batch.mask),
        }
        rows.append(row)
        if progress:
            print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return pd.DataFrame(rows)


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=WARM_STARTS, extra=options)
    p = PRESETS[args.preset]
    if args.replot:
        print(committed("sampler_mismatch.csv").to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        return
    init = args.init or warm_started(args.runs, layers=4, experts=16, top_k=2, steps=p["warm_steps"], seed=0)
    out = write_table(measure(init, p["prompts"], p["group_size"], not args.quiet), args.out / "sampler_mismatch.csv")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
