"""Does answer length change the picture? GRPO, GRPO + R2 and GSPO on pair sums with 4-, 16- and 64-token answers.

The GSPO paper's answers run to thousands of tokens; ours (compare.py) had 4. GSPO's sequence ratio is the geometric
mean of its token ratios, so it should clip whole answers more often as they lengthen (the paper reports ~15% of
tokens clipped against GRPO's ~0.13%), and a per-token routing change has more tokens to land on.

Hypotheses (issue 16, experiment 3): GSPO's clip fraction falls with answer length toward the paper's ~15% while
GRPO's stays near 1%; and whether replay (R2: the routes of the old-log-prob forward) matters more as answers
lengthen, read from the paired gap to GRPO of the same length and seed.

Setting: the tiny Qwen3-MoE (4 layers, 16 experts, top-2) warm-started on each length's pair sums (each answer digit
is a prompt digit plus the one before it, mod 10; up to 600 steps, stopping at sampled reward 0.35; one warm start
per length and seed, shared by the arms; running sums, whose every answer digit depends on all the digits before it,
stayed at chance from 16 tokens on; at 64 tokens pair sums did too, so that length has one seed). Then 8 prompts x
8 answers per step (half the other experiments' batch: a 64-token step takes about 8-9 times a 4-token one), μ = 4
minibatches, lr 1e-4, 50 steps, a 128-prompt held-out set evaluated every 10 steps.

    python experiments/long_answers.py --preset quick   # 4 and 16 tokens, 1 seed, 1 step: a smoke test
    python experiments/long_answers.py --preset full    # 4 and 16 tokens x 3 seeds, 64 tokens x 1; 3 arms (resumable)

Writes <out>/long_answers_steps.csv (every step of every run), long_answers_summary.csv and long_answers.png.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from common import LEARNED, ROUND3_ARMS, run_script, train_log
from matplotlib.figure import Figure
from paired_stats import gap_columns

ARMS = ROUND3_ARMS  # GRPO, GRPO + R2 and GSPO
HELDOUT = "eval/sampled/reward"
TASK = "pair_sum"
PRESETS = {
    "quick": {
        "lengths": [4, 16],
        "seeds": [0],
        "steps": 1,
        "warm_start_steps": 10,
        "train": {"prompts": 4, "group_size": 4, "minibatches": 2, "heldout_prompts": 16, "eval_every": 1},
    },
    "full": {  # 64 tokens: one seed (its 600-step warm start stayed at chance, so its arms test nothing)
        "lengths": [4, 16, 64],
        "seeds": {4: [0, 1, 2], 16: [0, 1, 2], 64: [0]},
        "steps": 50,
        "warm_start_steps": 600,
        "train": {"prompts": 8, "group_size": 8, "heldout_prompts": 128, "eval_every": 10},
    },
}


def run_all(preset: str, runs: Path, progress: bool) -> pd.DataFrame:
    """Train every arm at every length, seed by seed (runs resume if interrupted); return the logs."""
    p = PRESETS[preset]
    frames = []
    seeds = p["seeds"] if isinstance(p["seeds"], dict) else dict.fromkeys(p["lengths"], p["seeds"])
    for seed in sorted(set().union(*seeds.values())):
        for length in [n for n in p["lengths"] if seed in seeds[n]]:
            init = runs / f"init_{TASK}{length}_seed{seed}"  # shared by the arms
            for arm, settings in ARMS.items():
                tag = arm.lower().replace(" + ", "_").replace(" ", "_")
                log = train_log(
                    runs / f"{tag}_len{length}_seed{seed}",
                    init,
                    progress,
                    seed=seed,
                    task=TASK,
                    task_size=length,
                    steps=p["steps"],
                    warm_start_steps=p["warm_start_steps"],
                    **p["train"],
                    **settings,
                )
                frames.append(log.assign(answer_len=length, arm=arm, seed=seed))
    return pd.concat(frames, ignore_index=True)


def per_run(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per length, arm and seed: the first step's training reward (where the warm start left the policy), the
    final training reward (mean of the last 20% of steps), the held-out reward (mean of the last 3 evaluations), the
    share of tokens clipped
    (mean over steps), and both rewards' paired gaps to GRPO at the same length and seed."""
    rows = []
    for (length, arm, seed), run in frame.groupby(["answer_len", "arm", "seed"], sort=False):
        tail = run[run.step > run.step.max() * 0.8]
        held = run.dropna(subset=[HELDOUT])
        rows.append(
            {
                "answer_len": length,
                "arm": arm,
                "seed": seed,
                "start_reward": run.reward_mean.iloc[0],  # the warm start's level (chance is 0.1 per digit)
                "final_reward": tail.reward_mean.mean(),
                "heldout_reward": held[HELDOUT].tail(3).mean() if len(held) else np.nan,
                "clipped": run["clip_ratio/region_mean"].mean(),
            }
        )
    runs = pd.DataFrame(rows)
    keys = pd.MultiIndex.from_frame(runs[["answer_len", "seed"]])
    grpo = runs[runs.arm == "GRPO"].set_index(["answer_len", "seed"])
    for col in ("final_reward", "heldout_reward"):
        gap = "gap_to_grpo" if col == "final_reward" else "heldout_gap_to_grpo"
        runs[gap] = runs[col].to_numpy() - grpo[col].reindex(keys).to_numpy()
    return runs


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per length and arm, mean ± sd over seeds: final and held-out reward and clipped tokens; and the paired gaps to
    GRPO of the same length and seed, of the final and of the held-out reward (mean, standard error, sd, seeds ahead,
    paired t and sign-test p)."""
    runs = per_run(frame)
    cols = ["start_reward", "final_reward", "heldout_reward", "clipped"]
    g = runs.groupby(["answer_len", "arm"], sort=False)
    summary = g[cols].agg(["mean", "std"])
    summary.columns = [f"{c}_{s.replace('std', 'sd')}" for c, s in summary.columns]
    summary.insert(0, "seeds", g.seed.nunique())
    gaps = pd.DataFrame(  # (GRPO against itself has no gap)
        {
            key: {**gap_columns(r.gap_to_grpo), **gap_columns(r.heldout_gap_to_grpo, "heldout_gap_to_grpo")}
            for key, r in runs[runs.arm != "GRPO"].groupby(["answer_len", "arm"], sort=False)
        }
    ).T.rename_axis(["answer_len", "arm"])
    return summary.join(gaps).reset_index()


def figure(frame: pd.DataFrame) -> Figure:
    """Clipped tokens, the held-out reward (the primary metric) and its paired gap to GRPO, each against answer length
    (mean ± sd over seeds; seeds as dots; lengths not joined: each is its own task and warm start). A length whose warm
    start left the policy at chance is drawn hollow: its arms learned nothing, so it says nothing about length."""
    runs = summarize(frame)
    seeds = per_run(frame)
    fig = Figure(figsize=(12, 3.8), layout="constrained")
    axes = fig.subplots(1, 3)
    lengths = sorted(runs.answer_len.unique())
    start = runs.groupby("answer_len").start_reward_mean.first().reindex(lengths)
    learned = (start > LEARNED).to_numpy()
    counts = runs.groupby("answer_len").seeds.max().reindex(lengths)
    ticks = [
        f"{n}\n{counts[n]} seed" + ("s" if counts[n] > 1 else "") + ("" if ok else ", at chance")
        for n, ok in zip(lengths, learned, strict=True)
    ]
    panels = [
        ("clipped", "tokens clipped (%)", 100, list(ARMS)),
        ("heldout_reward", "held-out reward (last 3 evaluations)", 1, list(ARMS)),
        ("heldout_gap_to_grpo", "held-out reward − GRPO's (paired)", 1, [a for a in ARMS if a != "GRPO"]),
    ]
    for ax, (col, label, scale, arms) in zip(axes, panels, strict=True):
        for k, arm in enumerate(arms):
            part = runs[runs.arm == arm].set_index("answer_len").reindex(lengths)
            x = np.arange(len(lengths)) + (k - (len(arms) - 1) / 2) * 0.12
            color = f"C{list(ARMS).index(arm)}"
            y, err = part[f"{col}_mean"].to_numpy() * scale, part[f"{col}_sd"].fillna(0).to_numpy() * scale
            # (not joined: each length is its own task and warm start)
            ax.errorbar(x[learned], y[learned], err[learned], fmt="o", capsize=3, color=color, label=arm)
            ax.plot(x[~learned], y[~learned], "o", mfc="none", color=color)
            mine = seeds[seeds.arm == arm]
            for i, length in enumerate(lengths):
                dots = mine.loc[mine.answer_len == length, col] * scale
                ax.plot([x[i]] * len(dots), dots, ".", color=color, alpha=0.35)
        ax.set_xticks(range(len(lengths)), ticks)
        ax.set_xlabel(f"answer tokens ({TASK.replace('_', ' ')}s)")
        ax.set_ylabel(label)
        ax.legend(fontsize="x-small")
    axes[2].axhline(0, color="gray", lw=0.8)
    fig.suptitle("Longer answers: GRPO, GRPO + R2 and GSPO on pair sums (mean ± sd over seeds; dots are seeds)")
    return fig


if __name__ == "__main__":
    run_script(__doc__, PRESETS, "long_answers", run_all, summarize, figure)
