"""How far an engine-like sampler is from the fp32 trainer, on the RL loop's warm-started 4-layer policy: routing
mismatch (share of routed expert choices that differ), KL(sampler ‖ trainer) by k3, and |log-ratio| on the sampled
answer tokens, for bf16, fp16 and fp8-rounded samplers. The fp8 samplers simulate an engine; they are not one.

    python experiments/sampler_mismatch.py            # 64 prompts x 8 answers per sampler
    python experiments/sampler_mismatch.py --init runs/init   # reuse a warm-started policy (made there if missing)
    python experiments/sampler_mismatch.py --out experiments/results   # replace the committed table

Writes <out>/sampler_mismatch.csv (default runs/results; the committed one is experiments/results/sampler_mismatch.csv,
the table in docs/rl.md).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import pandas as pd
import torch
from common import OUT, RESULTS, write_table

from moe_replay import expert_change, teacher_forced_routes
from moe_replay.rl.policy import build_policy, warm_start
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--init", default=None, help="a warm-started policy directory (made there if missing)")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument(
        "--out", type=Path, default=OUT, help=f"where the CSV goes (default {OUT}; to commit: --out {RESULTS})"
    )
    opts = ap.parse_args()
    from transformers import AutoModelForCausalLM

    task = Task("addition", 3)
    init = Path(opts.init or tempfile.mkdtemp())
    if not (init / "config.json").exists():
        model = build_policy(seed=0)
        warm_start(model, task, steps=300, lr=3e-3, seed=0, target_reward=0.35)
        model.save_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init).eval()
    prompts, answers = task.sample(opts.prompts, torch.Generator().manual_seed(123))
    rows = []
    for dtype, quant in SAMPLERS:
        torch.manual_seed(0)
        sampler = make_sampler(model, dtype, quant)
        batch = rollout(model, task, prompts, answers, group_size=8, sampler=sampler)
        live = teacher_forced_routes(model, batch.sequences)
        change = expert_change(batch.routes, live)
        row = {
            "sampler": f"{dtype}{'' if quant == 'none' else ' + ' + quant}",
            "routing_mismatch": change.fraction,
            "tokens_with_a_moved_expert": change.token_changed,
            **mismatch_metrics(batch.trainer_logp, batch.sampler_logp, batch.mask),
        }
        rows.append(row)
        print(", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    out = write_table(pd.DataFrame(rows), opts.out / "sampler_mismatch.csv")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
