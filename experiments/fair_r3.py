"""A fair test of R3: a sampler that differs from the trainer only in which experts it selects.

Round 2's sampler (mismatch.py: bf16 weights rounded through fp8 e5m2) differs from the trainer in everything, and
routing is only about a quarter to two fifths of its KL to the trainer, so replaying its routes (R3) could remove
only that part. Here the sampler is the fp32 trainer itself whose routers pick their experts by logits + 0.04 ×
Gaussian noise (`rollout_selection_noise`): about 10% of routed expert choices differ from the trainer's at the warm
start, as the R3 paper measures between engines, while the gating weights at the chosen experts, and everything
else, stay exact. R3 replays those choices and recomputes the gating weights live, so it removes the mismatch
entirely. Arms as mismatch.py's: GRPO, GRPO + R2, GRPO + R3 with 6 paired seeds and GSPO with 3, each with π_old from
the trainer's recompute and from the sampler; the setting, steps and held-out metric are round 2's.

Prediction (written before the runs): with π_old from the sampler, R3 − GRPO > 0 (the routing noise in GRPO's ratios
is removed), and with π_old from the trainer the gap is within noise.

    python experiments/fair_r3.py --preset quick              # every arm, 1 seed, 1 step: a smoke test
    python experiments/fair_r3.py --preset full --shard 0/2   # half the seeds (run 1/2 beside it; resumable)
    python experiments/fair_r3.py --preset full               # the rest, then the summary and the figure

Writes <out>/fair_r3_steps.csv (every step of every run), fair_r3_summary.csv (mismatch.py's columns) and
fair_r3.png.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from common import WARM_STARTS, parse_args, publish, shard_option, sharded_steps, warm_started
from mismatch import SOURCES, figure, run_arm, summarize

NOISE = 0.04  # ~10% of routed expert choices differ at the warm start (--calibrate measures it)
ARMS = ("GRPO", "GRPO + R2", "GRPO + R3", "GSPO")
PRESETS = {
    "quick": {
        "seeds": {arm: [0] for arm in ARMS},
        "steps": 1,
        "warm_start_steps": 10,
        "eval_every": 1,
        "heldout": 8,
        "batch": (4, 4, 2),
    },  # fmt: skip
    "full": {
        "seeds": {arm: [0, 1, 2] if arm == "GSPO" else list(range(6)) for arm in ARMS},
        "steps": 100,
        "warm_start_steps": 300,
        "eval_every": 10,
        "heldout": 256,
        "batch": (16, 8, 4),
    },  # fmt: skip
}


def run_all(preset: str, runs: Path, progress: bool, shard: tuple[int, int] = (0, 1)) -> pd.DataFrame | None:
    """Train this shard's runs (the seeds s with s % `shard[1]` == `shard[0]`; runs resume if interrupted); with the
    whole plan (one shard) collect every run's log."""
    p = PRESETS[preset]
    k, n = shard
    frames = []
    for seed in sorted({s for seeds in p["seeds"].values() for s in seeds}):
        if seed % n != k:
            continue
        init = warm_started(runs / WARM_STARTS.name, steps=p["warm_start_steps"], seed=seed)
        for source in SOURCES:
            for method in (arm for arm in ARMS if seed in p["seeds"][arm]):
                frames.append(run_arm(runs, init, seed, method, source, p, progress, rollout_selection_noise=NOISE))
    return pd.concat(frames, ignore_index=True) if n == 1 else None


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/fair_r3_{preset}"), extra=shard_option)
    frame = sharded_steps(args, "fair_r3", run_all)
    if frame is not None:
        sampler = f"fp32 sampler with selection noise {NOISE} (gating weights exact)"
        publish(summarize(frame), figure(frame, sampler), args.out, "fair_r3", dpi=110)


if __name__ == "__main__":
    main()
