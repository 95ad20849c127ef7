"""GRPO with and without Routing Replay against GSPO, on a tiny MoE: reward curves with seeds and bands.

Reproduces (in kind, not in scale) the GSPO paper's MoE comparison (Zheng et al. 2025, arXiv 2507.18071, Fig. 1 and
§5.3): GRPO needs Routing Replay to converge on Qwen3-30B-A3B, GSPO converges without it and reaches a higher reward,
and GSPO clips far more tokens (~15%) than GRPO (~0.13%). A fourth arm, GSPO with replay, is a control none of the
papers shows.

How it differs from the paper: a tiny Qwen3-MoE (4 layers, 16 experts, top-2, 1.3M parameters) warm-started on
3-digit addition with per-digit partial credit, 16 prompts x 8 answers per step, μ = 4 minibatches, Adam, on 2 CPU
cores; several seeds per arm, where the paper shows one run.

    python experiments/compare.py --preset quick   # all arms, 1 seed, 4 steps: a smoke test (CI runs it)
    python experiments/compare.py --preset full    # 3 seeds x 4 arms x 200 steps: the README's numbers
    python experiments/compare.py --replot         # redraw the summary and figure from the committed CSV

Writes <out>/compare_steps.csv (every step of every run, tidy), compare_summary.csv and compare.png.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from common import run_script, running_mean, train_log
from matplotlib.figure import Figure
from paired_stats import gap_columns

from moe_replay.analysis import plots

ARMS = {
    "GRPO": {"importance_sampling_level": "token", "replay": "off"},
    "GRPO + replay": {"importance_sampling_level": "token", "replay": "rollout"},
    "GSPO": {"importance_sampling_level": "sequence", "replay": "off"},
    "GSPO + replay": {"importance_sampling_level": "sequence", "replay": "rollout"},
}
PRESETS = {
    "quick": {"seeds": [0], "train": {"steps": 4, "warm_start_steps": 30}},
    "full": {"seeds": [0, 1, 2], "train": {"steps": 200, "warm_start_steps": 300}},
}
THRESHOLD = 0.5  # reward threshold for "steps to reach"


def run_all(preset: str, runs: Path, progress: bool) -> pd.DataFrame:
    """Train every arm for every seed (runs resume if interrupted) and collect the step logs."""
    p = PRESETS[preset]
    frames = []
    for seed in p["seeds"]:
        init = runs / f"init_seed{seed}"  # one warm start per seed, shared by the arms
        for arm, settings in ARMS.items():
            tag = arm.lower().replace(" + ", "_").replace(" ", "_")
            log = train_log(runs / f"{tag}_seed{seed}", init, progress, seed=seed, **p["train"], **settings)
            frames.append(log.assign(arm=arm, seed=seed))
    return pd.concat(frames, ignore_index=True)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per arm: final reward (mean of the last 10% of steps) mean ± sd over seeds, its paired gap to GRPO at the same
    seed (mean, standard error, sd, seeds ahead, paired t and sign-test p), steps to THRESHOLD, clip rate, expert
    change per update, p99 |token log-ratio|."""
    last = frame.step > frame.step.max() * 0.9
    per_seed = frame[last].groupby(["arm", "seed"], sort=False).reward_mean.mean()
    reached = frame[frame.reward_mean >= THRESHOLD].groupby(["arm", "seed"], sort=False).step.min()
    rows = []
    for arm in frame.arm.unique():
        runs = frame[frame.arm == arm]
        rows.append(
            {
                "arm": arm,
                "final_reward_mean": per_seed[arm].mean(),
                "final_reward_sd": per_seed[arm].std() if len(per_seed[arm]) > 1 else float("nan"),
                **({} if arm == "GRPO" else gap_columns(per_seed[arm] - per_seed["GRPO"])),
                "seeds": runs.seed.nunique(),
                f"steps_to_{THRESHOLD}": reached[arm].mean()
                if arm in reached.index.get_level_values(0)
                else float("nan"),
                "clipped_tokens": runs["clip_ratio/region_mean"].mean(),
                "expert_change_per_update": runs.expert_change.mean(),
                "p99_abs_log_ratio": runs["abs_log_ratio/p99"].mean(),
            }
        )
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame) -> Figure:
    """Reward (10-step running mean) and its paired difference to GRPO (same seed and step), clipped tokens, expert
    change per update and p99 |log-ratio| over steps, mean ± sd over seeds."""
    frame = frame.replace({"arm": {"GRPO + replay": "GRPO + R3", "GSPO + replay": "GSPO + R3"}})
    frame = frame.assign(smooth=running_mean(frame, window=10))
    wide = frame.pivot_table(index=["seed", "step"], columns="arm", values="smooth")
    paired = (  # GRPO's own gap (0) stays, so that every arm keeps its colour
        wide.sub(wide["GRPO"], axis=0).reset_index().melt(id_vars=["seed", "step"], var_name="arm", value_name="gap")
    )
    fig = Figure(figsize=(15, 7), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    seeds = frame.seed.nunique()
    plots.over_training(frame, y="smooth", group="arm", ylabel="reward (10-step mean)", ax=axes[0], title="reward")
    plots.over_training(
        paired, y="gap", group="arm", ylabel="arm − GRPO, same seed", ax=axes[1], title="reward gap to GRPO (paired)"
    )
    axes[1].axhline(0.0, color="grey", lw=0.8)
    panels = [
        ("clip_ratio/region_mean", "clipped tokens", True),
        ("expert_change", "routed experts changed per update", True),
        ("abs_log_ratio/p99", "p99 |token log-ratio|", False),
    ]
    for ax, (col, label, percent) in zip(axes[3:], panels, strict=True):
        plots.over_training(frame, y=col, group="arm", ylabel=label, percent=percent, ax=ax, title=label)
    axes[2].set_visible(False)
    for ax in axes[3:]:  # the reward panels carry the legends
        ax.get_legend().remove()
    fig.suptitle(f"GRPO vs GSPO, with and without R3 replay, tiny MoE (mean ± sd over {seeds} seed(s))")
    return fig


if __name__ == "__main__":
    run_script(__doc__, PRESETS, "compare", run_all, summarize, figure, dpi=110)
