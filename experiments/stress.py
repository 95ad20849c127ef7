"""Why does replay fall behind under stress? Leave one stressor out at a time, and R2 against R3 in the full stress.

The sweep (sweep.py) found GRPO + R3 behind GRPO where routing drifts most: with all four stressors at once (lr 1e-3,
μ 16 minibatches, a bf16 sampler, routers × 0.25), −0.085 ± 0.020 final reward. That result is confounded: lr 1e-3
alone gives the run without replay the same reward, and both arms had gradient-norm spikes. This script removes one
stressor at a time (four settings) next to the full stress, for GRPO and GRPO + R3, and adds R2 (the old-log-prob
pass's routes) in the full stress, logging what could explain the gap: how far the last minibatch's live routing
has moved from the replayed routes, the clip fraction a live-routed forward would have had (the counterfactual),
the KL between consecutive sampling policies, and gradient-norm spikes.

Hypothesis (Qwen's 2512.01374 §3.2, "router staleness"): once more than 10% of routes have moved, replay trains the
policy under replayed routing, which has left the trust region; then the replayed arms fall behind in the settings
where the moved share is large (not where it is small), and their counterfactual live clip fraction is far above
the replayed one.

    python experiments/stress.py --preset quick   # 2 settings, 1 seed, a few steps: a smoke test
    python experiments/stress.py --preset full    # 5 settings x 2-3 arms x 3 seeds x 80 steps (resumable; ~2 hours)

Writes <out>/stress_steps.csv (every step of every run), stress_summary.csv and stress.png.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd
from common import WARM_STARTS, run_script, running_mean, train_log, warm_started
from matplotlib.figure import Figure
from paired_stats import gap_columns

from moe_replay.analysis import plots

STRESS = {"lr": 1e-3, "minibatches": 16, "rollout_dtype": "bfloat16", "router_scale": 0.25}
LEFT_OUT = {"lr": 1e-4, "minibatches": 4, "rollout_dtype": "float32", "router_scale": 1.0}  # the base values
SETTINGS = {"stress": STRESS} | {
    f"stress − {name}": STRESS | {key: LEFT_OUT[key]}
    for name, key in (("lr 1e-3", "lr"), ("μ 16", "minibatches"), ("bf16", "rollout_dtype"), ("flat", "router_scale"))
}
ARMS = {"GRPO": "off", "GRPO + R3": "rollout", "GRPO + R2": "old_logprob"}
R2_SETTINGS = ("stress",)  # R2 differs from R3 only through the sampler: compared where everything is on
SPIKE = 50.0  # a gradient norm above this (clipped to 1 before the step) counts as a spike
PRESETS = {
    "quick": {
        "settings": ["stress", "stress − lr 1e-3"],
        "seeds": [0],
        "warm_start_steps": 10,
        "train": {"steps": 1, "prompts": 4, "group_size": 4},  # 16 answers: one per minibatch at μ 16
    },
    "full": {"settings": list(SETTINGS), "seeds": [0, 1, 2], "warm_start_steps": 300, "train": {"steps": 80}},
}


def run_all(preset: str, runs: Path, progress: bool) -> pd.DataFrame:
    """Train every arm of every setting, seed by seed (runs resume if interrupted); return the logs."""
    p = PRESETS[preset]
    frames = []
    for seed in p["seeds"]:
        init = warm_started(runs / WARM_STARTS.name, steps=p["warm_start_steps"], seed=seed)
        for name in p["settings"]:
            for arm, replay in ARMS.items():
                if replay == "old_logprob" and name not in R2_SETTINGS:
                    continue
                tag = f"{name.replace(' − ', '-minus-').replace(' ', '')}_{replay}_seed{seed}"
                log = train_log(runs / tag, init, progress, seed=seed, replay=replay, **p["train"], **SETTINGS[name])
                frames.append(log.assign(setting=name, arm=arm, seed=seed))
    return pd.concat(frames, ignore_index=True)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting and arm: final reward (mean of the last 20% of steps) mean ± sd over seeds; the paired gap to
    GRPO of the same setting and seed (mean, standard error, sd, seeds ahead, paired t and sign-test p); the routes
    moved by the last minibatch, the counterfactual live clip fraction against the replayed one, the KL between
    consecutive sampling policies, and gradient-norm spikes."""
    rows = []
    for (name, arm), runs in frame.groupby(["setting", "arm"], sort=False):
        tail = runs[runs.step > runs.step.max() * 0.8]
        final = tail.groupby("seed").reward_mean.mean()
        base = frame[(frame.setting == name) & (frame.arm == "GRPO")]
        base_final = base[base.step > base.step.max() * 0.8].groupby("seed").reward_mean.mean()
        gap = (final - base_final).dropna()
        rows.append(
            {
                "setting": name,
                "arm": arm,
                "seeds": len(final),
                "final_reward_mean": final.mean(),
                "final_reward_sd": final.std(),
                **({} if arm == "GRPO" else gap_columns(gap)),
                "moved_since_rollout_last_minibatch": _mean(runs, "routes_moved_since_rollout/last_minibatch"),
                "clipped": runs["clip_ratio/region_mean"].mean(),
                "clipped_live_counterfactual": _mean(runs, "clip_ratio/live_counterfactual"),
                "kl_consecutive": _mean(runs, "policy/kl_consecutive"),
                "grad_norm_spikes": int((runs.grad_norm > SPIKE).sum()),
                "seeds_with_spikes": int(runs[runs.grad_norm > SPIKE].seed.nunique()),
            }
        )
    return pd.DataFrame(rows)


def _mean(runs: pd.DataFrame, column: str) -> float:
    return runs[column].mean() if column in runs else float("nan")


def figure(frame: pd.DataFrame) -> Figure:
    """Reward (5-step running mean, mean ± sd over seeds) per setting, each arm; below, the routes moved by the last
    minibatch (GRPO: live vs sampled; R3/R2: live vs replayed)."""
    frame = frame.assign(smooth=running_mean(frame))
    names = list(dict.fromkeys(frame.setting))
    fig = Figure(figsize=(3.4 * len(names), 6.4), layout="constrained")
    axes = fig.subplots(2, len(names), squeeze=False, sharey="row")
    for col, name in enumerate(names):
        part = frame[frame.setting == name]
        plots.over_training(part, y="smooth", group="arm", ylabel="reward (5-step mean)", ax=axes[0, col], title=name)
        plots.over_training(
            part.dropna(subset=["routes_moved_since_rollout/last_minibatch"]),
            y="routes_moved_since_rollout/last_minibatch",
            group="arm",
            percent=True,
            ylabel="routes moved, last minibatch",
            ax=axes[1, col],
            title=f"{name}: routes moved",
        )
        if col:
            for ax in axes[:, col]:
                ax.set_ylabel("")  # (shared y-axes: the first column's label says it)
                if ax.get_legend():
                    ax.get_legend().remove()
    fig.suptitle(
        f"Leave one stressor out: GRPO, R3 and R2 ({frame.seed.nunique()} seeds, mean ± sd). Below: the last "
        "minibatch's live routes moved since the rollout (GRPO: vs the sampled; R3/R2: vs the replayed)"
    )
    return fig


if __name__ == "__main__":
    run_script(__doc__, PRESETS, "stress", run_all, summarize, figure, dpi=100)
