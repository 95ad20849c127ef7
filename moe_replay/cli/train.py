"""`moe-replay train`: one RL run from a TOML config.

Example:
    $ moe-replay train --config configs/grpo_replay.toml --steps 10
"""

from __future__ import annotations

import argparse
from pathlib import Path

from .args import at_least


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the `train` subcommand."""
    p = sub.add_parser(
        "train",
        help="RL-train the tiny MoE policy (GRPO / GSPO / GSPO-token, with or without Routing Replay)",
        description="Run (or resume) an RL run described by a TOML file; see moe_replay.rl.config.TrainConfig.",
    )
    p.add_argument("--config", type=Path, required=True, help="TOML file (configs/*.toml)")
    p.add_argument("--output", help="override the output directory")
    p.add_argument("--steps", type=at_least(1), help="override the number of steps")
    p.add_argument("--seed", type=int, help="override the seed")
    p.add_argument("--fresh", action="store_true", help="start over instead of resuming from the last checkpoint")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    """Run `moe-replay train` with parsed arguments."""
    import pandas as pd

    from ..rl.config import load_config
    from ..rl.loop import STEP_LOG, train

    overrides = {
        k: v for k, v in (("output", args.output), ("steps", args.steps), ("seed", args.seed)) if v is not None
    }
    cfg = load_config(args.config, **overrides)
    out = train(cfg, resume=not args.fresh, progress=not args.quiet)
    log = pd.read_csv(out / STEP_LOG)
    last = log.tail(min(10, len(log)))
    print(
        f"{out}: {len(log)} steps, reward (mean of the last {len(last)}) {last.reward_mean.mean():.3f}, "
        f"exact match {last.exact_match.mean():.3f}, {log.seconds.mean():.2f} s/step"
    )
    return 0
