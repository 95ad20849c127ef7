"""How much of GRPO's token-ratio noise comes from routing changes: the same update, with and without Routing Replay.

Reproduces the mechanism behind the GSPO paper's MoE argument (Zheng et al. 2025, arXiv 2507.18071, §5.3): after
updates, a token whose experts changed is computed by another sub-network, so its ratio π_θ/π_old jumps for reasons
that are not the policy shift. Here, on each off-policy minibatch (2..μ) of GRPO training, the per-token log-ratio is
computed twice at the *same* weights: routing live, and replaying the experts π_old used. The difference is caused by
routing alone. Reported: the variance of the log-ratio, its 99th percentile, and the share of tokens outside GRPO's
clip band [1 − 0.2, 1 + 0.27], with and without replay.

How it differs from the paper: a tiny Qwen3-MoE (4 layers, 16 experts, top-2) warm-started on 3-digit addition,
16 prompts × 8 answers per step, μ = 4 minibatches, the update itself taken with replay (so both views see the same
weights), on 2 CPU cores.

    python experiments/mechanism.py --preset quick    # 10-step warm start, 1 learning rate, 1 step: a smoke test
    python experiments/mechanism.py --preset full     # 3 learning rates x 3 seeds x 5 steps (about a minute)
    python experiments/mechanism.py --replot          # redraw the summary and figure from the committed CSV

Starts from the warm start of experiments/expert_change.py's 4-layer variant (300 steps; made under --runs, default
runs/warm_starts, if missing) or from --init. Writes <out>/mechanism.csv and mechanism.png (default runs/results; the
committed ones: --out experiments/results).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from common import (
    HIGH,
    LOW,
    WARM_STARTS,
    committed,
    outside_clip,
    parse_args,
    same_weight_views,
    save_figure,
    warm_started,
    write_table,
)
from matplotlib.figure import Figure

from moe_replay.rl import Task, minibatch_update, rollout

PRESETS = {
    "quick": {"lrs": [1e-3], "seeds": [0], "steps": 1, "warm_steps": 10},
    "full": {"lrs": [1e-4, 3e-4, 1e-3], "seeds": [0, 1, 2], "steps": 5, "warm_steps": 300},
}


def run(lr: float, seed: int, steps: int, init: Path) -> list[dict]:
    """GRPO with rollout replay from the policy in `init`; on minibatches 2..4 of each step, the token log-ratios at
    the same weights routed live and replayed (one row per minibatch and view)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(init)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    task, g = Task("addition", 3), torch.Generator().manual_seed(seed)
    rows = []
    for step in range(steps):
        prompts, answers = task.sample(16, g)
        batch = rollout(model, task, prompts, answers, group_size=8, replay="rollout")
        for j, idx in enumerate(batch.minibatch_indices(4, g)):
            if j > 0:  # off-policy: the weights moved since π_old
                live, replayed, moved = same_weight_views(model, batch, idx)
                for view, lr_tok in (("live routing", live), ("routing replay", replayed)):
                    rows.append(
                        {
                            "lr": lr,
                            "seed": seed,
                            "step": step,
                            "minibatch": j,
                            "view": view,
                            "var_log_ratio": float(lr_tok.var()),
                            "p99_abs_log_ratio": float(lr_tok.abs().quantile(0.99)),
                            "outside_clip": outside_clip(lr_tok),
                            "experts_changed": moved,
                        }
                    )
            minibatch_update(model, opt, batch, idx, epsilon_low=LOW, epsilon_high=HIGH)
    return rows


def share(frame: pd.DataFrame, column: str) -> pd.Series:
    """Routing's share of `column` per lr and seed: 1 − replayed / live, each the mean over that seed's minibatches
    (paired: the same tokens at the same weights)."""
    means = frame.groupby(["lr", "seed", "view"])[column].mean().unstack("view")
    return 1 - means["routing replay"] / means["live routing"].where(means["live routing"] > 0)


def figure(frame: pd.DataFrame) -> Figure:
    """Variance, p99 and clipped share of the token log-ratio per lr, routed live vs replayed (mean ± sd over seeds,
    linear axes, each mean written on its bar), and the paired panel: routing's share 1 − replayed / live per seed."""
    fig = Figure(figsize=(12, 3.4), layout="constrained")
    axes = fig.subplots(1, 4)
    lrs = sorted(frame.lr.unique())
    for ax, col, label in zip(
        axes,
        ["var_log_ratio", "p99_abs_log_ratio", "outside_clip"],
        ["variance of token log-ratio", "p99 of |token log-ratio|", "tokens outside clip band (%)"],
        strict=False,
    ):
        top = 0.0
        for k, view in enumerate(["live routing", "routing replay"]):
            per = frame[frame.view == view].groupby(["lr", "seed"])[col].mean().groupby("lr")
            mean, sd = per.mean(), per.std().fillna(0)
            scale = 100 if col == "outside_clip" else 1
            xs = [i + (k - 0.5) * 0.38 for i in range(len(lrs))]
            bars = ax.bar(xs, mean.values * scale, width=0.38, yerr=sd.values * scale, label=view, capsize=2)
            # a linear axis (a log one shrinks the live/replayed difference out of sight); every value written above
            # its bar, since the low rates' bars are small next to lr 1e-3's
            ax.bar_label(bars, [f"{v:.3g}" for v in mean.values * scale], fontsize=6.5, rotation=90, padding=2)
            top = max(top, float((mean + sd).max()) * scale)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_xlabel("learning rate")
        ax.set_ylabel(label)
        ax.set_ylim(0, top * 1.2)  # (room for the values above the error bars)
    axes[0].legend(fontsize="small")
    ax = axes[3]
    for k, (col, label) in enumerate([("var_log_ratio", "of the variance"), ("outside_clip", "of clipped tokens")]):
        shares = share(frame, col) * 100
        per_lr = shares.groupby("lr")
        xs = [i + (k - 0.5) * 0.2 for i in range(len(lrs))]
        ax.errorbar(xs, per_lr.mean().values, per_lr.std().fillna(0).values, fmt="o", capsize=3, label=label)
        for i, lr in enumerate(lrs):
            dots = shares.xs(lr, level="lr").dropna()
            ax.plot([xs[i]] * len(dots), dots.values, ".", color=f"C{k}", alpha=0.4)
    ax.axhline(0, color="gray", lw=0.8)
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_xlabel("learning rate")
    ax.set_ylabel("routing's share, 1 − replayed / live (%)")
    ax.set_title("per seed (dots): mean ± sd", fontsize="medium")
    ax.legend(fontsize="small")
    seeds = frame.seed.nunique()
    fig.suptitle(f"GRPO minibatches 2-4: the same weights, routing live vs replayed (mean ± sd over {seeds} seeds)")
    return fig


def options(ap: argparse.ArgumentParser) -> None:
    """mechanism.py's own option: `--init`."""
    ap.add_argument(
        "--init", type=Path, help="a warm-started policy (save_pretrained folder) instead of the cached one"
    )


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=WARM_STARTS, extra=options)
    p = PRESETS[args.preset]
    if args.replot:
        frame = committed("mechanism.csv")
    else:
        init = args.init or warm_started(args.runs, layers=4, experts=16, top_k=2, steps=p["warm_steps"], seed=0)
        frame = pd.DataFrame([r for lr in p["lrs"] for s in p["seeds"] for r in run(lr, s, p["steps"], init)])
        write_table(frame, args.out / "mechanism.csv")
    summary = frame.groupby(["lr", "view"]).agg(
        var_log_ratio=("var_log_ratio", "mean"),
        p99=("p99_abs_log_ratio", "mean"),
        outside_clip=("outside_clip", "mean"),
        experts_changed=("experts_changed", "mean"),
    )
    print(summary.to_string(float_format=lambda v: f"{v:.4g}"))
    live = summary.xs("live routing", level="view")
    rep = summary.xs("routing replay", level="view")
    print(
        "share of log-ratio variance caused by routing, of the mean variances (pooled):",
        (1 - rep.var_log_ratio / live.var_log_ratio).round(3).to_dict(),
        "; mean of the per-seed shares (the figure):",
        share(frame, "var_log_ratio").groupby("lr").mean().round(3).to_dict(),
    )
    save_figure(figure(frame), args.out / "mechanism.png")
    print(f"wrote {args.out}/mechanism.csv and mechanism.png")


if __name__ == "__main__":
    main()
