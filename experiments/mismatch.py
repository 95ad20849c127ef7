"""Training–inference mismatch: does GRPO without replay fall behind when π_old comes from an engine-like sampler,
and do R3 or the importance-sampling correction close the gap?

The sampler is a bf16 copy of the policy whose weights are first rounded through fp8 e5m2 (an engine simulation, not
an engine): 8.6% of routed expert choices differ from the fp32 trainer's on the warm start
(experiments/sampler_mismatch.py), 5.1–6.9% during training (mismatch_summary.csv).
Arms: GRPO, GRPO + R2, GRPO + R3, GRPO + truncated importance sampling (per token, cap 3), GSPO; each with π_old from
the trainer's recompute and from the sampler. The convergence metric is the held-out reward (greedy and sampled, on
256 prompts never trained on), not the reward of training batches.

Hypothesis (to confirm or refute): with sampler π_old, GRPO without replay falls behind (a paired gap to the other
arms, by its standard error, sign count and paired t-test over seeds; a larger maximum drop of its held-out reward)
and R3 or the correction closes the gap.

    OMP_NUM_THREADS=1 python experiments/mismatch.py --preset quick   # every arm, 1 seed, 2 steps: a smoke test
    OMP_NUM_THREADS=1 python experiments/mismatch.py --preset full    # 5 seeds x 10 arms x 100 steps (~97 min)

Writes <out>/mismatch_steps.csv (every step of every run), mismatch_summary.csv and mismatch.png.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
from common import WARM_STARTS, run_script, running_mean, seed_label, seed_lines, train_log, warm_started
from matplotlib.axes import Axes
from matplotlib.colors import to_hex
from matplotlib.figure import Figure
from paired_stats import gap_columns, last_evaluations

from moe_replay.analysis import plots

SAMPLER = {"rollout_dtype": "bfloat16", "rollout_weight_quant": "fp8_e5m2"}
METHODS = {
    "GRPO": {"importance_sampling_level": "token", "replay": "off"},
    "GRPO + R2": {"importance_sampling_level": "token", "replay": "old_logprob"},
    "GRPO + R3": {"importance_sampling_level": "token", "replay": "rollout"},
    "GRPO + TIS": {"importance_sampling_level": "token", "replay": "off", "sampler_correction": "token_truncate"},
    "GSPO": {"importance_sampling_level": "sequence", "replay": "off"},
}
SOURCES = ("trainer", "sampler")
PRESETS = {
    "quick": {"seeds": [0], "steps": 2, "warm_start_steps": 10, "eval_every": 1, "heldout": 8, "batch": (4, 4, 2)},
    "full": {"seeds": [0, 1, 2, 3, 4], "steps": 100, "warm_start_steps": 300, "eval_every": 10, "heldout": 256},
}
HELDOUT = "eval/sampled/reward"


def run_all(preset: str, runs: Path, progress: bool) -> pd.DataFrame:
    """Train every arm for every seed (runs resume if interrupted) and collect the step logs."""
    p = PRESETS[preset]
    frames = []
    for seed in p["seeds"]:
        init = warm_started(runs / WARM_STARTS.name, steps=p["warm_start_steps"], seed=seed)
        for source in SOURCES:
            for method in METHODS:
                frames.append(run_arm(runs, init, seed, method, source, p, progress, **SAMPLER))
    return pd.concat(frames, ignore_index=True)


def run_arm(
    runs: Path, init: Path, seed: int, method: str, source: str, p: dict, progress: bool, **sampler: object
) -> pd.DataFrame:
    """Train (or resume) one arm, `method` of METHODS with π_old from `source`, at preset `p` with the `sampler`
    settings; its step log, tagged with arm, method, source and seed."""
    tag = f"{method.lower().replace(' + ', '_')}_{source}_seed{seed}"
    batch = dict(zip(("prompts", "group_size", "minibatches"), p.get("batch", (16, 8, 4)), strict=True))
    log = train_log(
        runs / tag,
        init,
        progress,
        seed=seed,
        steps=p["steps"],
        old_logprob_source=source,
        heldout_prompts=p["heldout"],
        eval_every=p["eval_every"],
        **batch,
        **sampler,
        **METHODS[method],
    )
    return log.assign(arm=f"{method}, π_old {source}", method=method, source=source, seed=seed)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per arm: the held-out reward (the mean of the last 3 evaluations) mean ± sd over seeds, the paired gap to GRPO
    with the same π_old source and seed (mean, standard error, sd, seeds ahead, paired t and sign-test p), the largest
    drop of the held-out reward from its running best, and the mean routing mismatch, sampler KL and clipped tokens
    of minibatches 2..μ."""
    evals = frame.dropna(subset=[HELDOUT])
    last = last_evaluations(frame, HELDOUT, ["arm", "seed"])
    drop = evals.groupby(["arm", "seed"])[HELDOUT].apply(lambda s: float((s.cummax() - s).max()))
    rows = []
    for arm in frame.arm.unique():
        runs = frame[frame.arm == arm]
        source = runs.source.iloc[0]
        base = last.xs(f"GRPO, π_old {source}", level="arm")
        gap = last.xs(arm, level="arm") - base
        rows.append(
            {
                "arm": arm,
                "heldout_reward_mean": last.xs(arm, level="arm").mean(),
                "heldout_reward_sd": last.xs(arm, level="arm").std() if len(gap) > 1 else float("nan"),
                **({} if arm == f"GRPO, π_old {source}" else gap_columns(gap)),
                "max_drop_mean": drop.xs(arm, level="arm").mean(),
                "seeds": runs.seed.nunique(),
                "routing_mismatch": runs["mismatch/fraction"].mean(),
                "sampler_kl_k3": runs["sampler/kl_k3"].mean(),
                "later_minibatches_clipped": runs["later_minibatches/clip_ratio/region_mean"].mean(),
            }
        )
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame, sampler: str = "bf16 + fp8-e5m2 sampler") -> Figure:
    """Per π_old source: the held-out reward over steps and its paired gap to GRPO of the same source and seed (the
    summary's metric), on shared y-axes, mean ± sd over seeds; and the routing mismatch and the sampler–trainer KL of
    every arm (the sampler's, whatever the source; the KL is against the trainer's forward under the arm's replay),
    each run's 5-step running mean, the mean over seeds only (colour: method, line style: source). Every legend entry
    says its arm's seed count."""
    evals = frame.dropna(subset=[HELDOUT])
    colors = {method: f"C{i}" for i, method in enumerate(dict.fromkeys(frame.method))}
    fig = Figure(figsize=(16, 7.5), layout="constrained")
    axes = fig.subplots(2, 3, gridspec_kw={"width_ratios": [1, 1, 1.25]})

    def by_method(data: pd.DataFrame, ax: Axes, **kw: object) -> None:
        """`plots.over_training` by method, each in its colour, labelled with its seed count."""
        counts = data.groupby("method", sort=False).seed.nunique()
        ax.set_prop_cycle(color=[to_hex(colors[m]) for m in counts.index])  # (a cycle takes no "C0")
        labelled = data.assign(method=data.method.map(lambda m: seed_label(m, counts[m])))
        plots.over_training(labelled, group="method", ax=ax, **kw)

    for col, source in enumerate(SOURCES):
        part = evals[evals.source == source]
        by_method(part, axes[0, col], y=HELDOUT, ylabel="held-out reward (sampled)", title=f"π_old from the {source}")
        wide = part.pivot_table(index=["seed", "step"], columns="method", values=HELDOUT)
        gap = wide.sub(wide["GRPO"], axis=0).reset_index()  # (GRPO's own 0 stays: every arm keeps its colour)
        gap = gap.melt(id_vars=["seed", "step"], var_name="method", value_name="gap").dropna()
        by_method(gap, axes[1, col], y="gap", ylabel="arm − GRPO, same source and seed",
                  title=f"paired gap to GRPO, π_old from the {source}")  # fmt: skip
        axes[1, col].axhline(0.0, color="grey", lw=0.8)
    for row in axes[:, :2]:
        low = min(ax.get_ylim()[0] for ax in row)
        high = max(ax.get_ylim()[1] for ax in row)
        for ax in row:
            ax.set_ylim(low, high)  # (the two sources' panels on one scale)
    arms = frame.assign(arm_source=frame.method + ", " + frame.source)
    arms = arms.assign(log_kl=np.log10(frame["sampler/kl_k3"].clip(lower=1e-16)))  # (the mean of the log: geometric)
    # each run's 5-step running mean (arm and seed: `running_mean`'s keys), so that 8-10 arms stay apart
    arms = arms.assign(mismatch=running_mean(arms, "mismatch/fraction"), log_kl=running_mean(arms, "log_kl"))
    keys = arms[["arm_source", "method", "source"]].drop_duplicates()
    line_colors = {k.arm_source: colors[k.method] for k in keys.itertuples()}
    styles = {k.arm_source: {"ls": "-" if k.source == "trainer" else "--"} for k in keys.itertuples()}
    for ax, y, scale, ylabel, title in (
        (axes[0, 2], "mismatch", 100, "routed experts: sampler vs trainer (%)", "routing mismatch"),
        (axes[1, 2], "log_kl", 1, "log10 KL(sampler ‖ trainer forward), k3", "sampler–trainer KL"),
    ):
        seed_lines(ax, arms, y, group="arm_source", scale=scale, runs=False, colors=line_colors, styles=styles)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title}, every arm\n(each run's 5-step mean; the mean over seeds)")
    fig.legend(*axes[0, 2].get_legend_handles_labels(), loc="outside right center", fontsize="x-small",
               title="right-hand panels\nsolid: π_old from the trainer\ndashed: from the sampler",
               title_fontsize="x-small")  # fmt: skip
    fig.suptitle(f"{sampler} against an fp32 trainer, tiny MoE (mean ± sd over seeds; seeds per arm in the legends)")
    return fig


if __name__ == "__main__":
    run_script(__doc__, PRESETS, "mismatch", run_all, summarize, figure, dpi=110)
